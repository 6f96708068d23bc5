"""The operator's policy on the real control plane: the operator runs with the chart's RBAC and the
policy the chart renders from its `policy` values (TANDEM_POLICY). A spec that mounts the node's `/`
is refused (Ready False PolicyDenied naming the field and how an admin allows it, one Warning event,
no Deployment); one under an allowed prefix runs; changing a running service to a refused spec
renders nothing new (what runs keeps running). And the API server itself refuses a node path with
'..' in it (the CRD's rule)."""

from __future__ import annotations

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException
from tandem.testing.chart import operator_container, render
from tandem.testing.cluster import wait_until
from tandem.testing.k8s_events import wait_events

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GVP = ("tandem.dev", "v1alpha1", "inferenceservices")
ROLE = {"gpus": 0, "cpu": "100m", "memory": "256Mi"}


def _body(name: str, host_path: str) -> dict:
    spec = {"model": {"hostPath": host_path}, "kvTransfer": {"backend": "tcp"}, "prefill": ROLE, "decode": ROLE}
    return {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name}, "spec": spec}


def _ready(api, namespace: str, name: str) -> dict:
    tis = client.CustomObjectsApi(api).get_namespaced_custom_object(*GVP[:2], namespace, GVP[2], name)
    return next((c for c in (tis.get("status") or {}).get("conditions") or [] if c["type"] == "Ready"), {})


def _deployments(api, namespace: str, name: str) -> dict[str, dict]:
    found = client.AppsV1Api(api).list_namespaced_deployment(namespace, label_selector=f"tandem.dev/service={name}")
    return {d.metadata.name: api.sanitize_for_serialization(d) for d in found.items}


def _volume(deployment: dict) -> dict:
    (model,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "model"]
    return model


def test_a_spec_the_policy_disallows_is_refused_and_an_allowed_one_runs(k8s, api, start_operator, chart_rbac,
                                                                        namespace):
    values = {"policy": {"namespaces": {namespace: {"hostPaths": ["/mnt/models"]}}}}
    env = {e["name"]: e.get("value") for e in operator_container(render(k8s.bin_dir / "helm", **values))["env"]}
    start_operator("--policy", env["TANDEM_POLICY"], kubeconfig=chart_rbac().kubeconfig)
    k8s.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump_all(
        [_body("root", "/"), _body("allowed", "/mnt/models/llama")]))

    refused = wait_until(lambda: (c := _ready(api, namespace, "root")).get("reason") == "PolicyDenied" and c,
                         timeout=60, what="root: Ready False PolicyDenied")
    assert refused["status"] == "False"
    for words in ("model.hostPath", "'/'", "/mnt/models", f"policy.namespaces.{namespace}.hostPaths"):
        assert words in refused["message"], refused["message"]
    wait_events(api, namespace, "root", lambda e: e.reason == "PolicyDenied" and e.type == "Warning",
                what="a PolicyDenied Warning event")

    running = wait_until(lambda: len(d := _deployments(api, namespace, "allowed")) == 3 and d, timeout=60,
                         what="the allowed service's three Deployments")
    assert _volume(running["allowed-prefill"])["hostPath"]["path"] == "/mnt/models/llama"
    assert _deployments(api, namespace, "root") == {}, "a refused spec renders nothing"

    k8s.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(_body("allowed", "/etc")))
    wait_until(lambda: _ready(api, namespace, "allowed").get("reason") == "PolicyDenied", timeout=60,
               what="allowed, changed to /etc: Ready False PolicyDenied")
    after = _deployments(api, namespace, "allowed")
    assert _volume(after["allowed-prefill"])["hostPath"]["path"] == "/mnt/models/llama", "nothing new applied"
    assert _deployments(api, namespace, "root") == {}

    with pytest.raises(ApiException) as e:
        client.CustomObjectsApi(api).create_namespaced_custom_object(
            *GVP[:2], namespace, GVP[2], _body("climb", "/mnt/models/../../etc"))
    assert "normalised" in e.value.body and "spec.model.hostPath" in e.value.body
