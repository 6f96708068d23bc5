"""autoscaling.<role>.mode External on the real control plane: the operator releases the Deployment's
replicas without resetting them, an HPA-like edit stays across reconciles and resyncs, status reports
what the Deployment runs; and the ReplicaSet removes exactly the pods marked for removal.
"""

from __future__ import annotations

import pytest
from kubernetes import client
from tandem.operator import api_client
from tandem.operator.config import FIELD_MANAGER
from tandem.testing.cluster import wait_until
from tandem.testing.kube_nodes import POOL_LABEL

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GVP = ("tandem.dev", "v1alpha1", "inferenceservices")


def cpu_spec(decode: int) -> dict:
    role = {"gpus": 0, "cpu": "100m", "memory": "1Gi", "nodeSelector": {POOL_LABEL: "cpu"}}
    return {"model": {"path": "/m"}, "prefill": dict(role), "decode": role | {"replicas": decode},
            "kvTransfer": {"backend": "tcp"}, "router": {"cpu": "50m", "memory": "128Mi"}}


@pytest.fixture(scope="module")
def operator(start_operator):
    return start_operator("--no-kv-probe")


def tis(api, ns: str, name: str) -> dict:
    return client.CustomObjectsApi(api).get_namespaced_custom_object(*GVP[:2], ns, GVP[2], name)


def patch_spec(api, ns: str, name: str, spec: dict) -> None:
    client.CustomObjectsApi(api).patch_namespaced_custom_object(*GVP[:2], ns, GVP[2], name, {"spec": spec})


def deployment(api, ns: str, name: str) -> dict:
    return api.sanitize_for_serialization(client.AppsV1Api(api).read_namespaced_deployment(name, ns))


def wait_status(api, ns: str, name: str, check, what: str, timeout: float = 30) -> dict:
    last: dict = {}

    def found():
        nonlocal last
        last = tis(api, ns, name).get("status") or {}
        return last if check(last) else None

    try:
        return wait_until(found, timeout=timeout, what=what)
    except TimeoutError:
        raise AssertionError(f"{what}; status: {last}") from None


def test_external_mode_releases_replicas_and_an_hpa_edit_stays(api, operator, namespace):
    name = "ext"
    body = {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name},
            "spec": cpu_spec(decode=2)}
    client.CustomObjectsApi(api).create_namespaced_custom_object(*GVP[:2], namespace, GVP[2], body)
    decode = f"{name}-decode"
    wait_until(lambda: api_client.owns_replicas(deployment(api, namespace, decode)), timeout=30,
               what="the operator owns the decode Deployment's replicas")
    assert deployment(api, namespace, decode)["spec"]["replicas"] == 2

    patch_spec(api, namespace, name, {"autoscaling": {"decode": {"mode": "External"}}})
    released = wait_until(lambda: (d := deployment(api, namespace, decode)) and not api_client.owns_replicas(d) and d,
                          timeout=30, what="the operator's claim on the decode replicas released")
    assert released["spec"]["replicas"] == 2, "released without falling back to the default of 1"
    assert api_client.owns_replicas(released, "tandem-operator-handover")
    status = wait_status(api, namespace, name, lambda s: (s.get("decode") or {}).get("mode") == "External",
                         "status reports decode in External mode")
    assert status["decode"]["reason"] == "External" and status["decode"]["replicas"] == 2
    cond = next(c for c in status["conditions"] if c["type"] == "Autoscaling")
    assert (cond["status"], cond["reason"]) == ("False", "External")

    # What an HPA does: write the scale subresource.
    client.AppsV1Api(api).patch_namespaced_deployment_scale(decode, namespace, {"spec": {"replicas": 3}})
    wait_status(api, namespace, name, lambda s: s["decode"].get("replicas") == 3 and s["decode"].get(
        "currentReplicas") == 3, "status reports the 3 replicas the HPA set")
    # A resync re-applies every child (a deleted Service comes back), and a spec change reconciles.
    client.CoreV1Api(api).delete_namespaced_service(decode, namespace)
    wait_until(lambda: client.CoreV1Api(api).read_namespaced_service(decode, namespace), timeout=30,
               what="the resync restores the decode Service")
    patch_spec(api, namespace, name, {"router": {"replicas": 2}})
    generation = tis(api, namespace, name)["metadata"]["generation"]
    wait_status(api, namespace, name, lambda s: s.get("observedGeneration") == generation,
                "the spec change reconciled")
    live = deployment(api, namespace, decode)
    assert live["spec"]["replicas"] == 3, "the HPA's count stays across resyncs and reconciles"
    assert not api_client.owns_replicas(live) and not any(
        e["manager"] == FIELD_MANAGER and "f:replicas" in (e.get("fieldsV1") or {}).get("f:spec", {})
        for e in live["metadata"]["managedFields"])

    # Back to the planner: the operator takes replicas again, within its limits.
    patch_spec(api, namespace, name, {"autoscaling": {"decode": {"mode": "Operator", "maxReplicas": 2}}})
    back = wait_until(lambda: (d := deployment(api, namespace, decode)) and api_client.owns_replicas(d) and d,
                      timeout=30, what="the operator owns the decode replicas again")
    assert back["spec"]["replicas"] == 2, "the external count, held to maxReplicas"


def _pods(api, ns: str, name: str, role: str) -> list[dict]:
    pods = client.CoreV1Api(api).list_namespaced_pod(
        ns, label_selector=f"tandem.dev/service={name},tandem.dev/role={role}").items
    return [p for p in api.sanitize_for_serialization(pods) if not p["metadata"].get("deletionTimestamp")]


def test_the_replicaset_removes_the_pod_marked_for_removal_not_the_newest(api, operator, namespace):
    """The ReplicaSet's own choice among equal pods is the newest; the mark (lowest
    pod-deletion-cost) makes it remove the oldest instead. A mark no longer chosen is cleared."""
    name = "mark"
    body = {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name},
            "spec": cpu_spec(decode=1)}
    client.CustomObjectsApi(api).create_namespaced_custom_object(*GVP[:2], namespace, GVP[2], body)
    (oldest,) = wait_until(lambda: _pods(api, namespace, name, "decode") or None, timeout=30, what="decode pod")
    patch_spec(api, namespace, name, {"decode": {"replicas": 2}})
    pods = wait_until(lambda: len(p := _pods(api, namespace, name, "decode")) == 2 and p, timeout=30,
                      what="two decode pods")
    newest = next(p for p in pods if p["metadata"]["name"] != oldest["metadata"]["name"])
    assert api_client.mark_for_removal(api, namespace, pods, (newest["metadata"]["name"],), "t0") == []
    assert api_client.mark_for_removal(api, namespace, _pods(api, namespace, name, "decode"),
                                  (oldest["metadata"]["name"],), "t1") == []
    marks = {p["metadata"]["name"]: p["metadata"].get("annotations") or {}
             for p in _pods(api, namespace, name, "decode")}
    assert marks[oldest["metadata"]["name"]][api_client.DELETION_COST] == "-1000"
    assert marks[oldest["metadata"]["name"]][api_client.CHOSEN] == "t1"
    assert api_client.DELETION_COST not in marks[newest["metadata"]["name"]], "the earlier mark is cleared"
    patch_spec(api, namespace, name, {"decode": {"replicas": 1}})
    (left,) = wait_until(lambda: len(p := _pods(api, namespace, name, "decode")) == 1 and p, timeout=30,
                         what="one decode pod left")
    assert left["metadata"]["name"] == newest["metadata"]["name"], "the marked (oldest) pod went"
