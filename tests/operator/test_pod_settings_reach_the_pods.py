"""Pod settings on the real control plane, with the operator running under the chart's RBAC: the
scheduler places pods of a PriorityClass, a RuntimeClass, a ServiceAccount and pull secrets; every
component has a PodDisruptionBudget that the disruption controller evaluates; the router can run as an
existing ServiceAccount its Role is bound to."""

from __future__ import annotations

import json

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from tandem.testing.cluster import wait_until
from tandem.testing.kube_nodes import POOL_LABEL
from tandem.testing.pod_workers import ready_pods
from tandem.testing.rbac import rbac_denials

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GVP = ("tandem.dev", "v1alpha1", "inferenceservices")


def test_settings_reach_every_pod_and_budgets_guard_each_component(k8s, api, start_operator, chart_rbac, namespace):
    # The operator's policy names the ServiceAccounts these pods may run as (by default: none).
    accounts = json.dumps({"default": {"serviceAccounts": ["weights-reader", "edge-proxy"]}})
    operator = start_operator("--policy", accounts, kubeconfig=chart_rbac().kubeconfig)
    priority = f"serving-{namespace}"[-63:]
    k8s.kubectl("apply", "-f", "-", input=f"""
apiVersion: scheduling.k8s.io/v1
kind: PriorityClass
metadata: {{name: {priority}}}
value: 100000
---
apiVersion: node.k8s.io/v1
kind: RuntimeClass
metadata: {{name: {priority}}}
handler: runc
""")
    core = client.CoreV1Api(api)
    for account in ("weights-reader", "edge-proxy"):
        core.create_namespaced_service_account(namespace, {"metadata": {"name": account}})
    settings = {"priorityClassName": priority, "runtimeClassName": priority,
                "imagePullSecrets": [{"name": "regcred"}]}
    role = {"replicas": 2, "gpus": 0, "cpu": "100m", "memory": "1Gi", "nodeSelector": {POOL_LABEL: "cpu"}}
    spec = {"model": {"path": "/m"}, "kvTransfer": {"backend": "tcp"},
            "prefill": role | {"podDisruptionBudget": {"minAvailable": 1}},
            "decode": role | settings | {"serviceAccountName": "weights-reader",
                                         "podDisruptionBudget": {"maxUnavailable": "50%"}},
            "router": {"serviceAccountName": "edge-proxy", "priorityClassName": priority}}
    name = "platform"
    try:
        client.CustomObjectsApi(api).create_namespaced_custom_object(
            *GVP[:2], namespace, GVP[2], {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService",
                                          "metadata": {"name": name}, "spec": spec})
        decode = wait_until(lambda: len(p := ready_pods(api, namespace, name, "decode")) == 2 and p, timeout=90,
                            what="two Ready decode pods")
        for pod in decode:
            s = pod["spec"]
            assert (s["priorityClassName"], s["runtimeClassName"], s["serviceAccountName"]) == (
                priority, priority, "weights-reader")
            assert s["priority"] == 100000, "the API server resolved the PriorityClass"
            assert s["imagePullSecrets"] == [{"name": "regcred"}] and s["automountServiceAccountToken"] is False
        (router,) = wait_until(lambda: ready_pods(api, namespace, name, "router") or None, timeout=60,
                               what="the router pod")
        assert router["spec"]["serviceAccountName"] == "edge-proxy"
        binding = client.RbacAuthorizationV1Api(api).read_namespaced_role_binding(f"{name}-router", namespace)
        assert [(s.kind, s.name) for s in binding.subjects] == [("ServiceAccount", "edge-proxy")]
        with pytest.raises(ApiException):
            core.read_namespaced_service_account(f"{name}-router", namespace)

        policy = client.PolicyV1Api(api)

        def evaluated():
            got = {b.metadata.name: b for b in policy.list_namespaced_pod_disruption_budget(
                namespace, label_selector=f"tandem.dev/service={name}").items}
            # The disruption controller sees the pods' readiness after the kubelet reports it: wait until
            # it counts every expected pod healthy (a fresh clone once read 0 disruptions allowed before).
            return got if len(got) == 3 and all(b.status and b.status.expected_pods
                                                and b.status.current_healthy == b.status.expected_pods
                                                for b in got.values()) else None

        budgets = wait_until(evaluated, timeout=60, what="three PodDisruptionBudgets the controller evaluated")
        assert budgets[f"{name}-decode"].status.expected_pods == 2
        assert budgets[f"{name}-decode"].status.disruptions_allowed == 1, "50% of 2"
        assert budgets[f"{name}-prefill"].status.disruptions_allowed == 1, "minAvailable 1 of 2"
        assert budgets[f"{name}-router"].spec.max_unavailable == 1
        assert not rbac_denials(operator.log()), "the chart's RBAC lacks what pod settings need"
    finally:
        k8s.kubectl("delete", "priorityclass,runtimeclass", priority, "--ignore-not-found", check=False)
