"""An idle pass observes the children from the operator's watches, not by listing them (issue 32.1).

On the real control plane, the operator runs with the chart's RBAC for one namespace and a resync
of 1 s; once its InferenceService is Ready and every pass has settled, the API server's audit log
(testing/audit.py) holds every call the operator made over several resync passes. Before this
issue a resync pass listed the Deployments, LeaderWorkerSets, pods and Services of its service and
read every child's metadata (16 calls); now the one call left is the internal Secret's
create-if-absent (409), the child the operator never reads and so cannot watch, and a settled pass
makes it only once every SECRET_CHECK_RESYNCS resyncs.
"""

from __future__ import annotations

import pytest
from kubernetes import client
from tandem.operator.act import SECRET_CHECK_RESYNCS
from tandem.testing.audit import AuditLog
from tandem.testing.cluster import wait_until
from tandem.testing.kube_nodes import POOL_LABEL
from tandem.testing.rbac import rbac_denials
from tandem.testing.scraped import scrape, value

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GVP = ("tandem.dev", "v1alpha1", "inferenceservices")
IDLE_RESYNCS = 12  # resync passes in the measured window (more than SECRET_CHECK_RESYNCS)
CHILDREN = {"deployments", "leaderworkersets", "pods", "replicasets", "statefulsets", "services", "configmaps",
            "serviceaccounts", "roles", "rolebindings", "networkpolicies", "poddisruptionbudgets", "jobs",
            "persistentvolumeclaims"}


def passes(operator, trigger: str | None = None) -> float:
    metrics = scrape(operator.liveness.rsplit("/", 1)[0] + "/metrics")
    labels = {"trigger": trigger} if trigger else {}
    return value(metrics, "tandem_operator_reconciles_total", **labels)


def ready(api, namespace: str, name: str) -> bool:
    body = client.CustomObjectsApi(api).get_namespaced_custom_object(*GVP[:2], namespace, GVP[2], name)
    status = body.get("status") or {}
    cond = next((c for c in status.get("conditions") or [] if c["type"] == "Ready"), {})
    return cond.get("status") == "True" and status.get("observedGeneration") == body["metadata"]["generation"]


def test_an_idle_resync_pass_lists_no_child_and_reads_none(k8s, api, start_operator, chart_rbac, namespace):
    if k8s.external:
        pytest.skip("needs the harness's own API server: the test reads its audit log")
    rbac = chart_rbac(watchNamespaces=[namespace])
    audit = AuditLog(k8s.work_dir, rbac.user)
    start = audit.mark()
    operator = start_operator("--namespace", namespace, "--resync-seconds", "1", "--kv-probe-timeout-seconds", "1",
                              kubeconfig=rbac.kubeconfig)
    name = "idle"
    role = {"replicas": 1, "gpus": 0, "cpu": "100m", "memory": "1Gi", "nodeSelector": {POOL_LABEL: "cpu"}}
    client.CustomObjectsApi(api).create_namespaced_custom_object(*GVP[:2], namespace, GVP[2], {
        "apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name},
        "spec": {"model": {"path": "/m"}, "prefill": dict(role), "decode": dict(role),
                 "kvTransfer": {"backend": "tcp"}}})
    wait_until(lambda: ready(api, namespace, name), timeout=120, what="the InferenceService Ready")
    made = audit.since(start)
    assert any(c.verb == "patch" and c.resource == "deployments" for c in made), \
        f"the audit log records the operator's applies: {[str(c) for c in made][:20]}"

    # Idle: two resync passes that called nothing but the Secret's create, then the measured window.
    window: list[str] = []

    def settled() -> bool:
        mark, resyncs = audit.mark(), passes(operator, "resync")
        wait_until(lambda: passes(operator, "resync") >= resyncs + 2, timeout=30, what="two resync passes")
        window[:] = [str(c) for c in audit.since(mark) if (c.verb, c.resource) != ("create", "secrets")]
        return not window

    try:
        wait_until(settled, timeout=120, what="resync passes that call nothing but the Secret's create")
    except TimeoutError:
        raise AssertionError(f"idle passes still call the API server: {window[:30]}") from None
    mark, before = audit.mark(), passes(operator)
    resyncs = passes(operator, "resync")
    wait_until(lambda: passes(operator, "resync") >= resyncs + IDLE_RESYNCS, timeout=90,
               what=f"{IDLE_RESYNCS} resync passes")
    calls, ran = audit.since(mark), passes(operator) - before
    lists = [str(c) for c in calls if c.verb == "list" and c.resource in CHILDREN]
    assert not lists, f"an idle pass listed children: {lists}"
    reads = [str(c) for c in calls if c.verb == "get"]
    assert not reads, f"an idle pass read what its watches hold: {reads}"
    others = [str(c) for c in calls if (c.verb, c.resource) != ("create", "secrets")]
    assert not others, f"an idle pass called more than the internal Secret's create-if-absent: {others}"
    secrets = [c for c in calls if c.code == 409]
    # a settled pass makes sure the Secret exists once every SECRET_CHECK_RESYNCS resyncs, not every pass
    assert len(secrets) <= ran // SECRET_CHECK_RESYNCS + 1, f"{len(secrets)} Secret creates in {ran} passes"
    assert ran >= IDLE_RESYNCS
    assert not rbac_denials(operator.log()), "the chart's RBAC lets the operator watch what it observes"
