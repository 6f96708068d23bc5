"""A decode worker whose tensor-parallel group spans 2 nodes, on the real control plane: the operator
renders a LeaderWorkerSet, the LWS controller (built from sigs.k8s.io/lws, its webhooks served by the
harness) makes the groups, the scheduler places each group's pods on distinct nodes of the decode
pool within one rack, the InferenceService is Ready only while every pod of a group is, and it
scales by whole groups, comes back when deleted (drift); a spec that fits the group on one node again
turns it back into a Deployment. The operator runs with the Helm chart's RBAC.

The test adds its own KWOK GPU nodes (pool `tp-groups`, two racks of two nodes) so that keeping a
group inside one rack is a real constraint; they are deleted at the end.
"""

from __future__ import annotations

import json

import pytest
from kubernetes import client
from tandem.testing.cluster import wait_until
from tandem.testing.kube_nodes import GPU_TOLERATION, POOL_LABEL, NodeSpec

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GVP = ("tandem.dev", "v1alpha1", "inferenceservices")
POOL = "tp-groups"
RACK = "tandem.test/rack"
NODES = {f"tp-{rack}-{i}": rack for rack in ("a", "b") for i in range(2)}
LWS_GROUP_INDEX = "leaderworkerset.sigs.k8s.io/group-index"


@pytest.fixture(scope="module")
def rack_nodes(k8s):
    """Four fake GPU nodes in two racks, for this module only."""
    with k8s.api_client() as api:
        core = client.CoreV1Api(api)
        for name, rack in NODES.items():
            node = NodeSpec(name, POOL).manifest()
            node["metadata"]["labels"][RACK] = rack
            core.create_node(node)
        try:
            yield NODES
        finally:
            for name in NODES:
                core.delete_node(name)


def spec(decode_replicas: int = 1) -> dict:
    cpu = {"gpus": 0, "cpu": "100m", "memory": "1Gi", "nodeSelector": {POOL_LABEL: "cpu"}}
    return {
        "model": {"path": "/models/tiny", "maxModelLen": 2048},
        "prefill": dict(cpu),
        "decode": {"replicas": decode_replicas, "gpus": 4, "cpu": "100m", "memory": "1Gi",
                   "parallelism": {"tensor": 8, "nodes": 2, "topologyKey": RACK},
                   "nodeSelector": {POOL_LABEL: POOL}, "tolerations": [dict(GPU_TOLERATION)]},
        "kvTransfer": {"backend": "tcp"},
        "router": {"cpu": "50m", "memory": "128Mi"},
    }


def _tis(api, ns: str, name: str) -> dict:
    return client.CustomObjectsApi(api).get_namespaced_custom_object(*GVP[:2], ns, GVP[2], name)


def _cond(tis: dict, type_: str) -> dict:
    return next((c for c in (tis.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def _status(api, ns: str, name: str) -> str:
    return json.dumps(_tis(api, ns, name).get("status"), indent=1)


def _decode_pods(api, ns: str, name: str) -> list:
    pods = client.CoreV1Api(api).list_namespaced_pod(
        ns, label_selector=f"tandem.dev/service={name},tandem.dev/role=decode").items
    return [p for p in pods if not p.metadata.deletion_timestamp]


def _groups(api, ns: str, name: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for pod in _decode_pods(api, ns, name):
        out.setdefault(pod.metadata.labels.get(LWS_GROUP_INDEX), []).append(pod)
    return out


def _ready_with(api, ns: str, name: str, summary: str) -> dict | None:
    tis = _tis(api, ns, name)
    st = tis.get("status") or {}
    ok = (_cond(tis, "Ready").get("status") == "True" and st.get("observedGeneration") == tis["metadata"]["generation"]
          and st.get("decode", {}).get("summary") == summary)
    return tis if ok else None


def _set_ready(api, pod, ready: bool) -> None:
    """What the kubelet writes when a container's readiness probe fails or passes again."""
    conditions = [c for c in api.sanitize_for_serialization(pod.status.conditions) if c["type"] != "Ready"]
    conditions.append({"type": "Ready", "status": "True" if ready else "False",
                       "reason": None if ready else "ContainersNotReady"})
    client.CoreV1Api(api).patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace,
                                                      {"status": {"conditions": conditions}})


@pytest.fixture(scope="module")
def operator(start_operator, chart_rbac):
    """One operator for the module (two would race for each service's internal Secret)."""
    return start_operator(kubeconfig=chart_rbac().kubeconfig)


def test_a_two_node_decode_group_is_placed_together_ready_as_one_and_scaled_by_groups(
        k8s, api, operator, namespace, rack_nodes):
    name = "tp"
    body = {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name},
            "spec": spec()}
    crds = client.CustomObjectsApi(api)
    crds.create_namespaced_custom_object(*GVP[:2], namespace, GVP[2], body)

    lws = wait_until(lambda: crds.get_namespaced_custom_object(
        "leaderworkerset.x-k8s.io", "v1", namespace, "leaderworkersets", f"{name}-decode"), timeout=60,
        what="the decode LeaderWorkerSet")
    assert lws["metadata"]["ownerReferences"][0]["name"] == name
    assert not client.AppsV1Api(api).list_namespaced_deployment(
        namespace, label_selector=f"tandem.dev/service={name},tandem.dev/role=decode").items
    try:
        wait_until(lambda: _ready_with(api, namespace, name, "1/1"), timeout=120, what="Ready with one group")
    except TimeoutError as e:
        raise AssertionError(f"{e}; status: {_status(api, namespace, name)}") from None

    # Placed together: a group's two pods on distinct nodes of the pool, in one rack; LWS told each
    # pod its leader and its index.
    group = _groups(api, namespace, name)["0"]
    nodes = sorted(p.spec.node_name for p in group)
    assert len(set(nodes)) == 2 and set(nodes) <= set(NODES), nodes
    assert len({NODES[n] for n in nodes}) == 1, f"the group spans racks: {nodes}"
    env = {p.metadata.labels["tandem.dev/group-member"]: {e.name: e.value for e in p.spec.containers[0].env
                                                          if e.value is not None} for p in group}
    assert env["leader"]["LWS_WORKER_INDEX"] == "0" and env["follower"]["LWS_WORKER_INDEX"] == "1"
    assert env["follower"]["LWS_LEADER_ADDRESS"] == f"{name}-decode-0.{name}-decode.{namespace}"
    assert env["leader"]["LWS_GROUP_SIZE"] == "2"

    # Ready only while every rank is: a follower failing its readiness probe takes the group out.
    follower = next(p for p in group if p.metadata.labels["tandem.dev/group-member"] == "follower")
    _set_ready(api, follower, False)
    tis = wait_until(lambda: (t := _tis(api, namespace, name)) and _cond(t, "DecodeReady").get("status") == "False"
                     and t, timeout=30, what="DecodeReady=False with a follower not ready")
    assert _cond(tis, "Ready")["status"] == "False"
    assert tis["status"]["decode"]["readyReplicas"] == 0
    assert "0/1 decode groups (2 pods each, ready when all are) ready" in _cond(tis, "DecodeReady")["message"]
    _set_ready(api, follower, True)
    wait_until(lambda: _ready_with(api, namespace, name, "1/1"), timeout=30, what="Ready again")

    # Scaled by whole groups: two groups of two pods, each inside one rack; then back to one.
    crds.patch_namespaced_custom_object(*GVP[:2], namespace, GVP[2], name, {"spec": {"decode": {"replicas": 2}}})
    try:
        wait_until(lambda: _ready_with(api, namespace, name, "2/2"), timeout=120, what="Ready with two groups")
    except TimeoutError as e:
        raise AssertionError(f"{e}; status: {_status(api, namespace, name)}") from None
    groups = _groups(api, namespace, name)
    assert sorted(groups) == ["0", "1"] and all(len(g) == 2 for g in groups.values())
    for index, pods in groups.items():
        assert len({NODES[p.spec.node_name] for p in pods}) == 1, f"group {index} spans racks"
    crds.patch_namespaced_custom_object(*GVP[:2], namespace, GVP[2], name, {"spec": {"decode": {"replicas": 1}}})
    wait_until(lambda: _ready_with(api, namespace, name, "1/1") and sorted(_groups(api, namespace, name)) == ["0"],
               timeout=120, what="one group left, the highest index removed whole")

    # Drift: a deleted LeaderWorkerSet comes back at the next resync, groups and all.
    crds.delete_namespaced_custom_object("leaderworkerset.x-k8s.io", "v1", namespace, "leaderworkersets",
                                         f"{name}-decode")
    wait_until(lambda: crds.get_namespaced_custom_object("leaderworkerset.x-k8s.io", "v1", namespace,
                                                         "leaderworkersets", f"{name}-decode")["metadata"]["uid"]
               != lws["metadata"]["uid"], timeout=60, what="the LeaderWorkerSet re-created")
    wait_until(lambda: _ready_with(api, namespace, name, "1/1"), timeout=120, what="Ready again after the drift")

    # Back to one node per group: the LeaderWorkerSet goes, a Deployment of 4-GPU pods takes over.
    crds.patch_namespaced_custom_object(*GVP[:2], namespace, GVP[2], name, {"spec": {"decode": {
        "parallelism": {"tensor": 4, "nodes": 1, "topologyKey": None}}}})
    wait_until(lambda: _ready_with(api, namespace, name, "1/1") and client.AppsV1Api(api).list_namespaced_deployment(
        namespace, label_selector=f"tandem.dev/service={name},tandem.dev/role=decode").items, timeout=120,
        what="the decode Deployment Ready")
    gone = crds.list_namespaced_custom_object("leaderworkerset.x-k8s.io", "v1", namespace, "leaderworkersets")
    assert gone["items"] == [] or all(i["metadata"].get("deletionTimestamp") for i in gone["items"])
    wait_until(lambda: all(LWS_GROUP_INDEX not in (p.metadata.labels or {}) for p in _decode_pods(api, namespace, name)),
               timeout=60, what="the groups' pods gone")


def test_a_group_larger_than_its_pool_is_reported_with_the_numbers(k8s, api, operator, namespace):
    """The default decode pool has two nodes: a group of three cannot be placed, and status says why."""
    name = "toolarge"
    bad = spec()
    bad["decode"] |= {"gpus": 1, "parallelism": {"tensor": 3, "nodes": 3},
                      "nodeSelector": {POOL_LABEL: "decode"}}
    client.CustomObjectsApi(api).create_namespaced_custom_object(*GVP[:2], namespace, GVP[2], {
        "apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name}, "spec": bad})
    tis = wait_until(lambda: (t := _tis(api, namespace, name)) and _cond(t, "DecodeReady").get("reason") == "Unschedulable"
                     and t, timeout=90, what="DecodeReady reason Unschedulable")
    message = _cond(tis, "DecodeReady")["message"]
    assert "a decode group needs 3 distinct nodes of its pool" in message, message
    assert "cannot be scheduled" in message
    assert _cond(tis, "Ready")["reason"] == "Unschedulable", json.dumps(tis["status"], indent=1)
