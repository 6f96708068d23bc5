"""observe() is a pure function of what the watches saw (operator/watch.py) and the owner chain: the
same objects give the same observation, a pod with copied labels is not counted, a pod whose
controller the watch has not seen is named for reading (missing_owners) and trusted once it is known,
and what an apply just returned stands in for the watch's older copy (Seen.overlaid)."""

from __future__ import annotations

from tandem.operator.observe import download, learn_owners, missing_owners, observe
from tandem.operator.watch import BY_KIND, Seen, kept

UID = "is-uid"


def ref(kind: str, name: str, uid: str, api_version: str = "apps/v1") -> dict:
    return {"apiVersion": api_version, "kind": kind, "name": name, "uid": uid, "controller": True}


def obj(kind: str, name: str, uid: str, owner: dict | None, labels: dict | None = None, **rest) -> dict:
    meta = {"name": name, "namespace": "ns", "uid": uid, "resourceVersion": "1", "labels": labels or {},
            "ownerReferences": [owner] if owner else []}
    return {"kind": kind, "metadata": meta, **rest}


def service_objects() -> dict[str, list[dict]]:
    owner = ref("InferenceService", "svc", UID, "tandem.dev/v1alpha1")
    deploy = obj("Deployment", "svc-decode", "d1", owner, {"tandem.dev/role": "decode"},
                 spec={"replicas": 1}, status={"readyReplicas": 1})
    rs = obj("ReplicaSet", "svc-decode-abc", "rs1", ref("Deployment", "svc-decode", "d1"))
    pod = obj("Pod", "svc-decode-abc-1", "p1", ref("ReplicaSet", "svc-decode-abc", "rs1"),
              {"tandem.dev/role": "decode"})
    impostor = obj("Pod", "impostor", "p2", None, {"tandem.dev/role": "decode"})
    router = obj("Service", "svc-router", "s1", owner)
    return {"Deployment": [deploy], "ReplicaSet": [rs], "Pod": [pod, impostor], "Service": [router]}


def test_the_same_objects_give_the_same_observation_and_labels_prove_nothing() -> None:
    seen = Seen(service_objects())
    owners: dict = {}
    learn_owners(seen, owners)
    assert missing_owners(seen, owners) == []
    first, second = (observe(seen, "svc", UID, dict(owners)) for _ in range(2))
    assert first == second
    decode = first.roles["decode"]
    assert [p["metadata"]["name"] for p in decode.pods] == ["svc-decode-abc-1"], "the impostor is not counted"
    assert decode.replicas == 1 and decode.ready == 1 and first.router_service
    assert observe(seen, "svc", "another-uid", dict(owners)).roles == {}, "another service's uid owns nothing"


def test_a_controller_the_watch_has_not_seen_is_named_and_trusted_once_read() -> None:
    objects = service_objects()
    objects.pop("ReplicaSet")
    seen, owners = Seen(objects), {}
    learn_owners(seen, owners)
    assert missing_owners(seen, owners) == [("ReplicaSet", "svc-decode-abc", "rs1")]
    assert observe(seen, "svc", UID, owners).roles["decode"].pods == [], "an unknown chain is not trusted"
    owners["rs1"] = ref("Deployment", "svc-decode", "d1")  # what the caller read
    assert len(observe(seen, "svc", UID, owners).roles["decode"].pods) == 1


def test_what_an_apply_returned_replaces_the_watch_copy_and_a_pruned_workload_goes() -> None:
    seen = Seen(service_objects())
    newer = obj("Deployment", "svc-decode", "d1", ref("InferenceService", "svc", UID, "tandem.dev/v1alpha1"),
                {"tandem.dev/role": "decode"}, spec={"replicas": 3}, status={"readyReplicas": 1})
    owners: dict = {}
    learn_owners(seen, owners)
    assert observe(seen.overlaid([newer]), "svc", UID, owners).roles["decode"].replicas == 3
    assert observe(seen.overlaid([], gone=["Deployment/svc-decode"]), "svc", UID, owners).roles == {}
    assert seen.fingerprint() != seen.overlaid([{**newer, "metadata": {**newer["metadata"],
                                                                      "resourceVersion": "2"}}]).fingerprint()


def test_a_failed_download_names_only_the_pods_its_job_controls() -> None:
    job = obj("Job", "svc-dl-1", "j1", None, status={"failed": 1})
    mine = obj("Pod", "svc-dl-1-x", "p9", ref("Job", "svc-dl-1", "j1", "batch/v1"))
    copied = obj("Pod", "copied", "p8", None)
    found, pods = download(Seen({"Job": [job], "Pod": [mine, copied]}), "svc-dl-1")
    assert found is job and pods == [mine]
    assert download(Seen({}), "svc-dl-1") == (None, [])


def test_an_index_keeps_no_more_than_a_pass_reads() -> None:
    fields = [{"manager": "tandem-operator", "operation": "Apply", "fieldsV1": {"f:spec": {"f:replicas": {}}}},
              {"manager": "kube-controller-manager", "operation": "Update", "subresource": "status"}]
    deploy = {"metadata": {"name": "d", "uid": "d1", "managedFields": fields},
              "spec": {"replicas": 2, "template": {"spec": {"containers": [{"name": "w"}]}}},
              "status": {"readyReplicas": 1}}
    kept_deploy = kept(deploy, BY_KIND["Deployment"])
    assert kept_deploy["kind"] == "Deployment" and kept_deploy["spec"] == {"replicas": 2}
    assert kept_deploy["status"] == {"readyReplicas": 1} and kept_deploy["metadata"]["managedFields"] == fields[:1]
    config = kept({"metadata": {"name": "c", "managedFields": fields}, "data": {"k": "v" * 1000}},
                  BY_KIND["ConfigMap"])
    assert config == {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}}
    group = kept({"metadata": {"name": "g"}, "spec": {"replicas": 1, "leaderWorkerTemplate": {"size": 2, "workerTemplate": {}}}},
                 BY_KIND["LeaderWorkerSet"])
    assert group["spec"] == {"replicas": 1, "leaderWorkerTemplate": {"size": 2}}
    pod = kept({"metadata": {"name": "p", "managedFields": fields}, "spec": {"containers": []}, "status": {"podIP": "x"}},
               BY_KIND["Pod"])
    assert "managedFields" not in pod["metadata"] and pod["status"] == {"podIP": "x"} and "spec" in pod
