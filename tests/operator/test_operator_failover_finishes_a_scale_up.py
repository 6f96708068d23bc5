"""High availability on the real control plane: two operators elect a leader on a Lease, with the
Helm chart's RBAC. The leader is SIGKILLed in the middle of a scale-up its planner decided; the
standby takes the Lease once it expires and finishes the scale-up, from the planner's count kept in
status. A leader stopped cleanly releases the Lease.

The planner reads a router and a decode worker that exist only as HTTP servers at their pods' IPs
(testing/pod_http.py): decode's KV is 99% used, so it asks for a second decode pod.
"""

from __future__ import annotations

import re

import pytest
from kubernetes import client
from tandem.testing.cluster import wait_until
from tandem.testing.k8s_events import wait_events
from tandem.testing.kube_nodes import POOL_LABEL
from tandem.testing.pod_http import PodHTTP, router_metrics, worker_metrics
from tandem.testing.pod_workers import ready_pods
from tandem.testing.rbac import rbac_denials
from tandem.testing.scraped import Samples, scrape, value

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GVP = ("tandem.dev", "v1alpha1", "inferenceservices")
LEADS = re.compile(r"leader election: (\S+) leads")


def spec() -> dict:
    role = {"replicas": 1, "gpus": 0, "cpu": "100m", "memory": "1Gi", "nodeSelector": {POOL_LABEL: "cpu"}}
    return {"model": {"path": "/m"}, "prefill": dict(role), "decode": dict(role), "kvTransfer": {"backend": "tcp"},
            "autoscaling": {"intervalSeconds": 5, "windowSeconds": 10, "decode": {"minReplicas": 1, "maxReplicas": 2}}}


def metrics(op) -> Samples:
    """An operator's /metrics, next to its liveness endpoint (a standby serves it too)."""
    return scrape(op.liveness.rsplit("/", 1)[0] + "/metrics")


def leader(op) -> str | None:
    found = LEADS.search(op.log())
    return found.group(1) if found else None


def holder(api, namespace: str, lease: str) -> str | None:
    return client.CoordinationV1Api(api).read_namespaced_lease(lease, namespace).spec.holder_identity


def status(api, namespace: str, name: str) -> dict:
    return client.CustomObjectsApi(api).get_namespaced_custom_object(*GVP[:2], namespace, GVP[2], name).get(
        "status") or {}


def test_the_standby_finishes_a_scale_up_after_the_leader_is_killed(api, start_operator, chart_rbac, namespace):
    rbac = chart_rbac()
    first = start_operator(*rbac.election(), kubeconfig=rbac.kubeconfig)
    me = wait_until(lambda: leader(first), timeout=30, what="the first operator leading")
    second = start_operator(*rbac.election(), kubeconfig=rbac.kubeconfig)
    wait_until(lambda: "waits for Lease" in second.log(), timeout=30, what="the second operator standing by")
    assert holder(api, rbac.namespace, rbac.lease) == me
    assert value(metrics(second), "tandem_operator_leader") == 0 and value(metrics(first), "tandem_operator_leader") == 1

    name = "ha"
    client.CustomObjectsApi(api).create_namespaced_custom_object(
        *GVP[:2], namespace, GVP[2], {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService",
                                      "metadata": {"name": name}, "spec": spec()})
    pods = {role: wait_until(lambda r=role: ready_pods(api, namespace, name, r) or None, timeout=60,
                             what=f"a Ready {role} pod")[0] for role in ("router", "decode")}
    servers = [PodHTTP(pods["router"]["status"]["podIP"], 8000, {"/metrics": router_metrics()}),
               PodHTTP(pods["decode"]["status"]["podIP"], 8000, {"/metrics": worker_metrics()})]
    try:
        wait_until(lambda: (status(api, namespace, name).get("decode") or {}).get("replicas") == 2, timeout=90,
                   what="the leader's planner raising decode to 2")
        first.proc.kill()  # mid-scale-up: the second decode pod is on its way
        first.proc.wait(10)

        other = wait_until(lambda: leader(second), timeout=60, what="the standby taking the Lease")
        assert other != me and holder(api, rbac.namespace, rbac.lease) == other
        wait_until(lambda: f"{namespace}/{name}: generation" in second.log(), timeout=60,
                   what="the new leader's first pass over the service")
        log = second.log()
        assert log.index("leads") < log.index(f"{namespace}/{name}: generation"), "a standby reconciled"

        def finished():
            s = status(api, namespace, name)
            ready = next((c for c in s.get("conditions") or [] if c["type"] == "Ready"), {})
            return s if ready.get("status") == "True" and s["decode"]["summary"] == "2/2" else None

        done = wait_until(finished, timeout=90, what="the new leader reporting decode 2/2 Ready")
        assert done["decode"]["replicas"] == 2 and done["decode"]["mode"] == "Operator"
        deployment = client.AppsV1Api(api).read_namespaced_deployment(f"{name}-decode", namespace)
        assert deployment.spec.replicas == 2, "the new leader kept the planner's count from status"
        (event,) = wait_events(api, namespace, name, lambda e: e.reason == "ScaledUp", "the ScaledUp event")
        assert event.message.startswith("decode 1 -> 2")
        # The new leader's planner decides afresh, from the count in status, and says what it read.
        def decided() -> Samples | None:
            m = metrics(second)
            return m if value(m, "tandem_operator_planner_decisions_total", inferenceservice=name) else None

        m = wait_until(decided, timeout=30, what="a decision of the new leader's planner in its metrics")
        assert value(m, "tandem_operator_leader") == 1
        assert value(m, "tandem_operator_planner_desired_replicas", inferenceservice=name, role="decode") == 2
        assert value(m, "tandem_operator_planner_input", inferenceservice=name, role="decode", input="kv_usage") \
            == pytest.approx(0.99)
        assert value(m, "tandem_operator_planner_decisions_total", inferenceservice=name, direction="down") == 0
    finally:
        for s in servers:
            s.close()

    second.stop()  # SIGTERM: kopf stops, then the Lease is released
    assert second.proc.returncode == 0, second.log()[-3000:]
    assert holder(api, rbac.namespace, rbac.lease) is None, "a leader stopping cleanly releases the Lease"
    assert not rbac_denials(first.log() + second.log()), "the chart's RBAC lacks what leader election does"
