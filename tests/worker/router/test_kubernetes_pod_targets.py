"""How one pod (as the API returns it) becomes a worker target: role, URL, port and readiness."""

from __future__ import annotations

from tandem.contracts.names import Role
from tandem.worker.router.discovery.kubernetes import pod_target, snapshot_targets
from tandem.worker.router.pool import Target


def _pod(name: str, role: str, generation: str = "g1") -> dict:
    return {
        "metadata": {"name": name, "labels": {
            "tandem.dev/service": "svc", "tandem.dev/role": role, "tandem.dev/generation": generation}},
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
    new = _ready(_pod("new", "decode", generation="g2"), "10.0.0.9")
    for pods in ({"old": old, "new": new}, {"new": new, "old": old}):
        (t,) = snapshot_targets(pods, 80)
        assert t.ready and t.generation == "g2"
