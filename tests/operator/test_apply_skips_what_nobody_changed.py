"""A pass applies a child again only when the manifest or the object changed since the last apply,
and a child's watch event is drift only when someone else changed it (the operator at scale: an idle
pass applies nothing, and a controller writing a child's status starts no apply). Pure."""

from __future__ import annotations

from tandem.operator.children import Applied, _digest, _untouched, drifted

CONFIG_MAP = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x-config", "labels": {"a": "1"}},
              "data": {"k": "v"}}
DEPLOYMENT = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x-decode", "labels": {"a": "1"}},
              "spec": {"replicas": 2}}


def _live(rv: str, generation: int | None = None, labels: dict | None = None) -> dict:
    meta = {"resourceVersion": rv, "labels": labels if labels is not None else {"a": "1"}}
    if generation is not None:
        meta["generation"] = generation
    return {"metadata": meta}


def test_the_same_manifest_over_the_same_object_is_not_applied_again():
    digest = _digest(CONFIG_MAP)
    last = Applied(digest, "10")
    assert _untouched(_live("10"), CONFIG_MAP, last, digest)
    assert not _untouched(_live("11"), CONFIG_MAP, last, digest), "someone changed it: apply (drift)"
    changed = {**CONFIG_MAP, "data": {"k": "w"}}
    assert not _untouched(_live("10"), changed, last, _digest(changed)), "a new manifest: apply"
    assert not _untouched(_live("10"), CONFIG_MAP, None, digest), "never applied by this process: apply"


def test_a_workload_whose_status_moved_is_judged_by_its_spec_generation_and_labels():
    digest = _digest(DEPLOYMENT)
    last = Applied(digest, "20", generation=3)
    assert _untouched(_live("25", generation=3), DEPLOYMENT, last, digest), "only its status moved"
    assert not _untouched(_live("26", generation=4), DEPLOYMENT, last, digest), "kubectl scale: apply"
    assert not _untouched(_live("27", generation=3, labels={"a": "2"}), DEPLOYMENT, last, digest)
    assert not _untouched(_live("25"), CONFIG_MAP, Applied(_digest(CONFIG_MAP), "20"), _digest(CONFIG_MAP)), \
        "a kind without a spec generation: the resourceVersion alone"


def test_a_watch_event_is_drift_only_when_the_spec_or_our_labels_changed():
    last = Applied(_digest(DEPLOYMENT), "20", generation=3, labels=(("a", "1"),))
    assert not drifted(_live("20", generation=3), last), "what the apply left"
    assert not drifted(_live("25", generation=3), last), "its controller wrote its status (a Job's, a PDB's too)"
    assert drifted(_live("26", generation=4), last)
    assert drifted(_live("27", generation=3, labels={"a": "2"}), last)
    assert drifted(_live("21"), Applied(_digest(CONFIG_MAP), "20")), "a ConfigMap edited"
