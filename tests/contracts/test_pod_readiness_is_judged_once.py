"""One rule for "this pod may get traffic", used by the operator's KV probe and the router's discovery."""

from __future__ import annotations

from tandem.contracts.names import pod_port, pod_ready, pod_url


def _pod(ready="True", ip="10.0.0.5", phase="Running", deleting=False, port=None):
    pod = {"metadata": {"name": "p"}, "status": {"podIP": ip, "phase": phase,
                                                   "conditions": [{"type": "Ready", "status": ready}]},
           "spec": {"containers": [{"ports": [{"name": "http", "containerPort": port}] if port else []}]}}
    if deleting:
        pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return pod


def test_ready_needs_condition_ip_running_and_not_deleting():
    assert pod_ready(_pod())
    assert not pod_ready(_pod(ready="False"))
    assert not pod_ready(_pod(ip=None))
    assert not pod_ready(_pod(phase="Pending"))
    assert not pod_ready(_pod(deleting=True))


def test_url_uses_the_named_port_and_brackets_ipv6():
    assert pod_url(_pod()) == "http://10.0.0.5:8000"
    assert pod_url(_pod(port=9000)) == "http://10.0.0.5:9000"
    assert pod_url(_pod(ip="fd00::5")) == "http://[fd00::5]:8000"
    assert pod_url(_pod(ip=None)) is None
    assert pod_port(_pod(port=9000)) == 9000
