"""The operator's own Prometheus metrics on the real control plane: scraped from the running
operator's /metrics (next to its liveness endpoint) while it reconciles, fails to apply, probes pods
that do not answer, and forgets a deleted InferenceService. (The planner's decisions and inputs, and
the leader gauge of a standby: test_operator_failover_finishes_a_scale_up.py.)"""

from __future__ import annotations

import pytest
from kubernetes import client
from tandem.testing.cluster import wait_until
from tandem.testing.kube_nodes import POOL_LABEL
from tandem.testing.scraped import Samples, value
from tandem.testing.scraped import scrape as scraped

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GVP = ("tandem.dev", "v1alpha1", "inferenceservices")


def scrape(operator) -> Samples:
    """The operator's /metrics, next to its liveness endpoint."""
    return scraped(operator.liveness.rsplit("/", 1)[0] + "/metrics")


def create(api, namespace: str, name: str, affinity: dict | None = None) -> None:
    role = {"replicas": 1, "gpus": 0, "cpu": "100m", "memory": "1Gi", "nodeSelector": {POOL_LABEL: "cpu"}}
    spec = {"model": {"path": "/m"}, "prefill": dict(role), "decode": dict(role), "kvTransfer": {"backend": "tcp"}}
    if affinity is not None:
        spec["decode"]["affinity"] = affinity
    client.CustomObjectsApi(api).create_namespaced_custom_object(
        *GVP[:2], namespace, GVP[2], {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService",
                                      "metadata": {"name": name}, "spec": spec})


def test_reconciles_errors_queue_and_scrape_failures_are_counted(api, start_operator, namespace):
    operator = start_operator("--kv-probe-timeout-seconds", "1")
    assert value(scrape(operator), "tandem_operator_leader") == 1, "without election this replica leads"
    create(api, namespace, "counted")
    refused = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}}
    create(api, namespace, "refused", affinity=refused)

    def counted():
        m = scrape(operator)
        return m if (value(m, "tandem_operator_reconciles_total", trigger="resync") >= 2
                     and value(m, "tandem_operator_reconcile_errors_total", reason="ApplyFailed") >= 1
                     and value(m, "tandem_operator_scrape_failures_total", kind="router_report") >= 1) else None

    m = wait_until(counted, timeout=90, what="resyncs, an ApplyFailed and a failed read of a router's report counted")
    assert value(m, "tandem_operator_reconciles_total", trigger="spec") >= 2
    assert value(m, "tandem_operator_reconciles_total", trigger="child") >= 1
    passes = value(m, "tandem_operator_reconciles_total")
    assert value(m, "tandem_operator_reconcile_duration_seconds_count") >= passes - 8, "every finished pass timed"
    assert value(m, "tandem_operator_queue_wait_seconds_count") >= passes - 8
    assert value(m, "tandem_operator_scrape_failures_total", kind="router_report", reason="refused") >= 1, \
        "the router pods' IPs answer nothing: connection refused"
    assert ("tandem_operator_queue_depth", ()) in m and ("tandem_operator_queue_active", ()) in m

    # The operator keeps state for exactly the InferenceServices that exist (all namespaces: other
    # tests' may come and go), and for none once deleted.
    def held_matches(expected_here: int):
        here = len(client.CustomObjectsApi(api).list_namespaced_custom_object(*GVP[:2], namespace, GVP[2])["items"])
        total = len(client.CustomObjectsApi(api).list_cluster_custom_object(*GVP[:2], GVP[2])["items"])
        return here == expected_here and value(scrape(operator), "tandem_operator_services") == total

    wait_until(lambda: held_matches(2), timeout=60, what="state held for every InferenceService")
    for name in ("counted", "refused"):
        client.CustomObjectsApi(api).delete_namespaced_custom_object(*GVP[:2], namespace, GVP[2], name)
    wait_until(lambda: held_matches(0), timeout=60, what="nothing kept for the deleted InferenceServices")
