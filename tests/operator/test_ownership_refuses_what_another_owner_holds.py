"""Whose an existing object is (issue 21.6), judged before any apply. Pure."""

from __future__ import annotations

from tandem.operator.config import OperatorConfig
from tandem.operator.ownership import refusal, secret_record
from tandem.operator.render import render
from tandem.operator.render.trust import ANNOTATION_SECRET_UID


def _manifest(meta: dict) -> dict:
    return {"kind": "ConfigMap", "metadata": {"name": "llama-config", "ownerReferences": [
        {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService", "name": meta["name"], "uid": meta["uid"],
         "controller": True}]}}


def _live(*refs: dict) -> dict:
    return {"metadata": {"name": "llama-config", "ownerReferences": list(refs)}}


def test_only_an_object_this_inference_service_controls_is_its_own(meta):
    manifest = _manifest(meta)
    ours = dict(manifest["metadata"]["ownerReferences"][0])
    assert refusal(_live(ours), manifest) is None
    bare = refusal(_live(), manifest)
    assert bare and not bare.retryable and "ConfigMap/llama-config exists and has no controller" in bare.message
    helm = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "someone", "uid": "x", "controller": True}
    other = refusal(_live(helm), manifest)
    assert other and "is controlled by Deployment/someone" in other.message and not other.retryable
    assert refusal(_live(dict(ours, controller=False)), manifest), "a non-controller reference proves nothing"


def test_a_group_service_its_leader_worker_set_made_is_ours(meta):
    """The LWS controller makes a headless Service named after the LeaderWorkerSet when it finds none;
    that name is the role's Service: the operator's, through its LeaderWorkerSet."""
    service = {"kind": "Service", "metadata": {"name": "llama-decode", "ownerReferences": [
        {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService", "name": meta["name"], "uid": meta["uid"],
         "controller": True}]}}
    lws = {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet", "name": "llama-decode",
           "uid": "l-1", "controller": True}
    assert refusal(_live(lws), service) is None
    other = dict(lws, name="someone-else")
    assert refusal(_live(other), service), "an LWS of another name holds it: refused"


def test_a_predecessor_of_the_same_name_is_waited_for():
    meta = {"name": "llama", "uid": "new"}
    earlier = {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService", "name": "llama", "uid": "old",
               "controller": True}
    r = refusal(_live(earlier), _manifest(meta))
    assert r and r.retryable and "garbage collector" in r.message


def test_the_internal_secret_is_used_only_when_this_operator_created_it():
    assert secret_record("s", "u-1", None) == ({"name": "s", "uid": "u-1"}, None), "a 201: created now"
    record, refused = secret_record("s", None, None)
    assert record is None and refused and "did not create it" in refused.message, "a 409 with no record: refused"
    kept = {"internalSecret": {"name": "s", "uid": "u-1"}}
    assert secret_record("s", None, kept) == ({"name": "s", "uid": "u-1"}, None), "a 409 of the one it created"
    assert secret_record("s", None, {"observedGeneration": 3}) == ({"name": "s"}, None), \
        "an operator before the record created it before its first apply"
    assert secret_record("s", "u-2", kept)[0] == {"name": "s", "uid": "u-2"}, "created again: the new uid"


def test_every_pod_template_carries_the_secret_uid(typed, meta):
    spec = typed({"model": {"path": "/m"}})
    templates = [m["spec"]["template"] for m in render(meta, spec, OperatorConfig(), secret_uid="u-9")
                 if m["kind"] == "Deployment"]
    assert len(templates) == 3
    assert all(t["metadata"]["annotations"][ANNOTATION_SECRET_UID] == "u-9" for t in templates)
    plain = render(meta, spec, OperatorConfig())
    assert not any(ANNOTATION_SECRET_UID in m["spec"]["template"]["metadata"]["annotations"]
                   for m in plain if m["kind"] == "Deployment")
