"""`spec.gateway` on the real control plane (the operator as a subprocess with the Helm chart's RBAC):
where the gateway's CRDs are missing, GatewayReady says so and everything else is still applied;
once they are installed (testing/gateway_crds.py, structural schemas of what Tandem renders), the
InferencePool of the decode pods, the picker and the HTTPRoute are applied, accepted by the API
server's schema, and GatewayReady turns True with a picker pod ready. The decode pods carry the
sidecar behind the pool's target port; the NetworkPolicy opens that port and lets the picker reach
the workers. A spec whose decode group spans nodes is refused at apply.
"""

from __future__ import annotations

import json

import pytest
import yaml
from kubernetes import client
from tandem.contracts import gateway
from tandem.testing.cluster import wait_until
from tandem.testing.gateway_crds import CRDS
from tandem.testing.inference_services import condition, read
from tandem.testing.kube_nodes import POOL_LABEL

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

CPU = {"gpus": 0, "cpu": "100m", "memory": "1Gi", "nodeSelector": {POOL_LABEL: "cpu"}}


def spec(**gateway_spec) -> dict:
    return {"model": {"path": "/models/tiny", "maxModelLen": 2048}, "prefill": dict(CPU), "decode": dict(CPU),
            "kvTransfer": {"backend": "tcp"}, "router": {"cpu": "50m", "memory": "128Mi"},
            "gateway": {"enabled": True, **gateway_spec}}


def body(name: str, s: dict) -> dict:
    return {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name}, "spec": s}


@pytest.fixture(scope="module")
def operator(start_operator, chart_rbac):
    return start_operator(kubeconfig=chart_rbac().kubeconfig)


def _gateway_condition(api, ns: str, name: str, reason: str) -> dict:
    def seen() -> dict | None:
        c = condition(read(api, ns, name), "GatewayReady")
        return c if c.get("reason") == reason else None

    try:
        return wait_until(seen, timeout=120, what=f"GatewayReady {reason}")
    except TimeoutError as e:
        raise AssertionError(f"{e}; status: {json.dumps(read(api, ns, name).get('status'), indent=1)}") from None


def _custom(api, group: str, plural: str, ns: str, name: str) -> dict:
    return client.CustomObjectsApi(api).get_namespaced_custom_object(group, "v1", ns, plural, name)


def test_the_pool_waits_for_the_gateways_crds_then_is_rendered_and_ready(k8s, api, operator, namespace):
    name = "gw"
    k8s.kubectl("apply", "-n", namespace, "-f", "-",
                input=yaml.safe_dump(body(name, spec(failureMode="FailClose", parentRefs=[{"name": "edge"}]))))
    missing = _gateway_condition(api, namespace, name, "GatewayAPIMissing")
    assert missing["status"] == "False" and "Inference Extension" in missing["message"], missing
    apps = client.AppsV1Api(api)
    decode = apps.read_namespaced_deployment(f"{name}-decode", namespace)  # the rest was applied
    containers = {c.name: c for c in decode.spec.template.spec.containers}
    assert set(containers) == {"worker", "gateway"}
    sidecar = containers["gateway"]
    assert [p.container_port for p in sidecar.ports] == [gateway.SIDECAR_PORT]
    files = client.CoreV1Api(api).read_namespaced_config_map(f"{name}-config", namespace).data
    sidecar_config = yaml.safe_load(files["sidecar.yaml"])
    assert sidecar_config["prefill_dns"] == f"{name}-prefill.{namespace}.svc:8000"
    assert sidecar_config["gateway_decode"] == "http://127.0.0.1:8000" and "kubernetes" not in sidecar_config
    assert not decode.spec.template.spec.automount_service_account_token  # the sidecar needs no API access

    for crd in CRDS:
        k8s.kubectl("apply", "-f", "-", input=yaml.safe_dump(crd))
    ready = _gateway_condition(api, namespace, name, "PickerReady")
    assert ready["status"] == "True"
    pool = _custom(api, gateway.INFERENCE_GROUP, "inferencepools", namespace, name)
    assert pool["spec"]["selector"]["matchLabels"] == {"tandem.dev/service": name, "tandem.dev/role": "decode"}
    assert pool["spec"]["targetPorts"] == [{"number": gateway.SIDECAR_PORT}]
    assert pool["spec"]["endpointPickerRef"] == {"name": f"{name}-picker", "port": {"number": gateway.PICKER_PORT},
                                                 "failureMode": "FailClose"}
    route = _custom(api, "gateway.networking.k8s.io", "httproutes", namespace, name)
    assert route["spec"]["parentRefs"][0]["name"] == "edge"
    assert route["spec"]["rules"][0]["backendRefs"] == [
        {"group": gateway.INFERENCE_GROUP, "kind": "InferencePool", "name": name}]
    picker = apps.read_namespaced_deployment(f"{name}-picker", namespace).spec.template.spec
    (c,) = picker.containers
    assert c.command[-4:] == ["--ext-proc-port", str(gateway.PICKER_PORT), "--gateway-port", str(gateway.SIDECAR_PORT)]
    assert c.readiness_probe.grpc.service == gateway.HEALTH_READINESS
    assert picker.service_account_name == f"{name}-router"  # it discovers the pods the router does
    svc = client.CoreV1Api(api).read_namespaced_service(f"{name}-picker", namespace)
    assert [(p.port, p.app_protocol) for p in svc.spec.ports] == [(gateway.PICKER_PORT, "kubernetes.io/h2c")]
    policy = client.NetworkingV1Api(api).read_namespaced_network_policy(f"{name}-workers", namespace)
    rules = api.sanitize_for_serialization(policy)["spec"]["ingress"]
    assert {"ports": [{"protocol": "TCP", "port": "gateway"}]} in rules
    assert any(peer.get("podSelector", {}).get("matchLabels", {}).get("tandem.dev/role") == "picker"
               for r in rules for peer in r.get("from", []))
    assert condition(read(api, namespace, name), "Ready")["status"] == "True"


def test_a_decode_group_spanning_nodes_is_refused_behind_a_gateway(k8s, crd_installed, namespace):
    s = spec()
    s["decode"] = {**CPU, "gpus": 4, "parallelism": {"tensor": 8, "nodes": 2}}
    out = k8s.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(body("gwlws", s)), check=False)
    assert out.returncode != 0 and "cannot be behind a gateway" in out.stderr, out.stderr
