"""The router runs at the Restricted pod security level and the Services expose the right pods."""

from __future__ import annotations

import yaml
from tandem.operator.config import OperatorConfig
from tandem.operator.render import endpoint, render

CONFIG = OperatorConfig()


def _by(manifests: list[dict], kind: str, name: str) -> dict:
    return next(m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name)


def test_children_are_the_documented_set(typed, meta):
    out = render(meta, typed({"model": {"path": "/m"}}), CONFIG)
    assert sorted((m["kind"], m["metadata"]["name"]) for m in out) == sorted([
        ("ConfigMap", "llama-config"),
        ("ServiceAccount", "llama-router"), ("Role", "llama-router"), ("RoleBinding", "llama-router"),
        ("Service", "llama-prefill"), ("Service", "llama-decode"), ("Service", "llama-router"),
        ("Deployment", "llama-prefill"), ("Deployment", "llama-decode"), ("Deployment", "llama-router"),
        ("NetworkPolicy", "llama-workers"),
        ("PodDisruptionBudget", "llama-prefill"), ("PodDisruptionBudget", "llama-decode"),
        ("PodDisruptionBudget", "llama-router"),
    ])
    # the ConfigMap and the NetworkPolicy come before the pods they concern
    kinds = [m["kind"] for m in out]
    assert kinds.index("ConfigMap") < kinds.index("Deployment")
    assert kinds.index("NetworkPolicy") < kinds.index("Deployment")


def test_router_pod_meets_restricted_pod_security(typed, meta):
    out = render(meta, typed({"model": {"path": "/m"}}), CONFIG)
    pod = _by(out, "Deployment", "llama-router")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    c = pod["containers"][0]
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
        "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]},
    }
    assert c["command"] == ["tandem", "router", "--config", "/etc/tandem/config.yaml"]
    assert pod["serviceAccountName"] == "llama-router"
    assert "nvidia.com/gpu" not in (c["resources"].get("limits") or {})


def test_router_role_grants_only_reads_of_pods_and_their_owners(typed, meta):
    out = render(meta, typed({"model": {"path": "/m"}}), CONFIG)
    role = _by(out, "Role", "llama-router")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["apps"], "resources": ["replicasets", "deployments", "statefulsets"], "verbs": ["get"]},
        {"apiGroups": ["leaderworkerset.x-k8s.io"], "resources": ["leaderworkersets"], "verbs": ["get"]},
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
    ]
    binding = _by(out, "RoleBinding", "llama-router")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "llama-router", "namespace": "serving"}]


def test_router_pod_drains_before_it_is_killed(typed, meta):
    out = render(meta, typed({"model": {"path": "/m"}}), CONFIG)
    pod = _by(out, "Deployment", "llama-router")["spec"]["template"]["spec"]
    prestop = pod["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace = yaml.safe_load(_by(out, "ConfigMap", "llama-config")["data"]["router.yaml"])["shutdown_grace_s"]
    assert pod["terminationGracePeriodSeconds"] > prestop + grace


def test_services_and_endpoint(typed, meta):
    spec = typed({"model": {"path": "/m"}, "router": {"service": {"type": "NodePort", "port": 9000}}})
    out = render(meta, spec, CONFIG)
    router = _by(out, "Service", "llama-router")["spec"]
    assert router["type"] == "NodePort"
    assert router["ports"] == [{"name": "http", "port": 9000, "targetPort": "http", "protocol": "TCP"}]
    assert router["selector"] == {"tandem.dev/service": "llama", "tandem.dev/role": "router"}
    for role in ("prefill", "decode"):
        svc = _by(out, "Service", f"llama-{role}")["spec"]
        assert svc["clusterIP"] == "None"
        assert svc["selector"] == {"tandem.dev/service": "llama", "tandem.dev/role": role}
    assert endpoint("llama", "serving", spec) == "http://llama-router.serving.svc.cluster.local:9000"


def test_router_config_and_api_key(examples, typed, meta):
    spec = typed(examples["gpu-roce"]["spec"])
    out = render(meta, spec, CONFIG)
    cfg = yaml.safe_load(_by(out, "ConfigMap", "llama-config")["data"]["router.yaml"])
    assert cfg["kubernetes"] is True and cfg["namespace"] == "serving" and cfg["service"] == "llama"
    assert cfg["max_prompt_tokens"] == 7168 and cfg["max_tokens_limit"] == 1024
    assert cfg["model"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert cfg["max_body_bytes"] == 4194304 and cfg["policy"] == "least-loaded"
    c = _by(out, "Deployment", "llama-router")["spec"]["template"]["spec"]["containers"][0]
    key = next(e for e in c["env"] if e["name"] == "TANDEM_API_KEY")
    assert key["valueFrom"] == {"secretKeyRef": {"name": "llama-8b-api-key", "key": "api-key"}}
    # limits default to the model's context when unset
    cfg2 = yaml.safe_load(_by(render(meta, typed({"model": {"path": "/m"}}), CONFIG), "ConfigMap",
                              "llama-config")["data"]["router.yaml"])
    assert cfg2["max_prompt_tokens"] == 4095 and cfg2["max_body_bytes"] == 1048576


def test_render_is_pure_and_deterministic(typed, meta, examples):
    affinity = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 1, "preference": {"matchExpressions": [{"key": "a", "operator": "Exists"}]}}]}}
    raw = examples["gpu-roce"]["spec"] | {"decode": examples["gpu-roce"]["spec"]["decode"] | {"affinity": affinity}}
    spec = typed(raw)
    snapshot = spec.to_dict()
    assert render(meta, spec, CONFIG) == render(meta, spec, CONFIG)
    assert spec.to_dict() == snapshot, "render must not modify its input"


def test_pods_meet_restricted_unless_rdma_needs_more(typed, meta, examples):
    from tandem.testing.pod_security import restricted_violations

    out = render(meta, typed(examples["cpu"]["spec"]), CONFIG)
    for role in ("prefill", "decode", "router"):
        pod = _by(out, "Deployment", f"llama-{role}")["spec"]["template"]["spec"]
        assert restricted_violations(pod) == [], role
    out = render(meta, typed(examples["gpu-roce"]["spec"]), CONFIG)
    assert restricted_violations(_by(out, "Deployment", "llama-router")["spec"]["template"]["spec"]) == []
    worker = _by(out, "Deployment", "llama-prefill")["spec"]["template"]["spec"]
    assert any("IPC_LOCK" in v for v in restricted_violations(worker))


def test_every_rendered_kind_has_an_apply_path(typed, meta, examples):
    from tandem.operator.api_client import PATHS

    for example in examples.values():
        for m in render(meta, typed(example["spec"]), CONFIG):
            assert (m["apiVersion"], m["kind"]) in PATHS
