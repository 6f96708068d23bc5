"""How one pod (as the API returns it) becomes a worker target: role, URL, port and readiness."""

from __future__ import annotations

from tandem.contracts.names import Role
from tandem.router.discovery.kubernetes import (
    controller_ref,
    owned_by_service,
    pod_target,
    snapshot_targets,
)
from tandem.router.workers import Target


def _pod(name: str, role: str, kv_compat: str = "g1") -> dict:
    return {
        "metadata": {"name": name, "labels": {
            "tandem.dev/service": "svc", "tandem.dev/role": role, "tandem.dev/kv-compat": kv_compat}},
        "spec": {"containers": [{"name": "worker", "ports": [{"name": "http", "containerPort": 8123}]}]},
    }


def _ready(pod: dict, ip: str = "10.0.0.7") -> dict:
    pod["status"] = {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}
    return pod


def test_pod_target_readiness_rules():
    pod = _ready(_pod("x", "decode"))
    assert pod_target(pod, 80) == Target("http://10.0.0.7:8123", Role.DECODE, "g1", True)
    pod["status"]["conditions"][0]["status"] = "False"
    assert pod_target(pod, 80).ready is False
    pod["status"]["conditions"][0]["status"] = "True"
    pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert pod_target(pod, 80).ready is False
    del pod["status"]["podIP"]
    assert pod_target(pod, 80) is None
    router_pod = _pod("r", "router")
    router_pod["status"] = {"podIP": "10.0.0.8"}
    assert pod_target(router_pod, 80) is None
    ipv6 = _pod("y", "prefill")
    ipv6["spec"]["containers"][0]["ports"] = []
    ipv6["status"] = {"phase": "Running", "podIP": "fd00::1", "conditions": [{"type": "Ready", "status": "True"}]}
    assert pod_target(ipv6, 8000).url == "http://[fd00::1]:8000"


def test_snapshot_keeps_the_ready_pod_when_an_ip_is_reused():
    old = _pod("old", "decode")
    old["status"] = {"phase": "Running", "podIP": "10.0.0.9", "conditions": [{"type": "Ready", "status": "False"}]}
    new = _ready(_pod("new", "decode", kv_compat="g2"), "10.0.0.9")
    for pods in ({"old": old, "new": new}, {"new": new, "old": old}):
        (t,) = snapshot_targets(pods, 80)
        assert t.ready and t.kv_compat == "g2"


# --- trust: only the service's own Deployments' pods ---------------------------------------------

IS_REF = {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService", "name": "svc", "uid": "is-1",
          "controller": True}


def _obj(name: str, uid: str, owner: dict | None) -> dict:
    return {"metadata": {"name": name, "uid": uid, "ownerReferences": [owner] if owner else []}}


def _ref(kind: str, name: str, uid: str, api: str = "apps/v1", controller: bool = True) -> dict:
    return {"apiVersion": api, "kind": kind, "name": name, "uid": uid, "controller": controller}


def test_a_replica_set_counts_only_through_a_deployment_the_service_controls():
    deployments = {"svc-decode": _obj("svc-decode", "d-1", IS_REF)}
    get = deployments.get
    assert owned_by_service(_obj("rs", "r-1", _ref("Deployment", "svc-decode", "d-1")), "svc", get)
    # the Deployment read back is another object than the one referenced (same name, new uid)
    assert not owned_by_service(_obj("rs", "r-1", _ref("Deployment", "svc-decode", "d-old")), "svc", get)
    assert not owned_by_service(_obj("rs", "r-1", _ref("Deployment", "gone", "d-9")), "svc", get)
    assert not owned_by_service(_obj("rs", "r-1", None), "svc", get)
    assert not owned_by_service(_obj("rs", "r-1", _ref("Deployment", "svc-decode", "d-1", controller=False)),
                                "svc", get)
    assert not owned_by_service(_obj("rs", "r-1", _ref("StatefulSet", "svc-decode", "d-1")), "svc", get)
    assert not owned_by_service(_obj("rs", "r-1", _ref("Deployment", "svc-decode", "d-1")), "other", get)
    impostor = {"svc-decode": _obj("svc-decode", "d-1", IS_REF | {"apiVersion": "evil.io/v1"})}
    assert not owned_by_service(_obj("rs", "r-1", _ref("Deployment", "svc-decode", "d-1")), "svc", impostor.get)


def test_controller_ref_needs_the_controller_flag_kind_and_group():
    pod = _obj("p", "p-1", _ref("ReplicaSet", "rs", "r-1"))
    assert controller_ref(pod, "ReplicaSet", "apps")["uid"] == "r-1"
    assert controller_ref(pod, "ReplicaSet", "extensions") is None
    assert controller_ref(_obj("p", "p-1", _ref("ReplicaSet", "rs", "r-1", controller=False)), "ReplicaSet",
                          "apps") is None
    assert controller_ref({"metadata": {}}, "ReplicaSet", "apps") is None
