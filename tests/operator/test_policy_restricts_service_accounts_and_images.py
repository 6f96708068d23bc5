"""What creating an InferenceService grants, restricted by the operator's policy (issue 28 item 3), on the
real control plane: the operator runs with the chart's RBAC and the policy the chart renders from its
`policy` values. Under the secure default (no named ServiceAccounts, no images beyond the operator's
own) a router asking to run as another ServiceAccount of its namespace is refused (Ready False
PolicyDenied naming the field) and nothing is created for it, no RoleBinding above all; where the
policy allows that ServiceAccount the operator binds its router Role to exactly it; a foreign router
image is refused even there."""

from __future__ import annotations

import pytest
import yaml
from kubernetes import client
from tandem.testing.chart import operator_container, render
from tandem.testing.cluster import wait_until
from tandem.testing.rbac import rbac_denials

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GVP = ("tandem.dev", "v1alpha1", "inferenceservices")
ROLE = {"gpus": 0, "cpu": "100m", "memory": "256Mi"}
ACCOUNT = "tenant-router"  # another ServiceAccount of the namespace, not the one the operator makes


def _body(name: str, router: dict) -> dict:
    spec = {"model": {"path": "/m"}, "kvTransfer": {"backend": "tcp"}, "prefill": ROLE, "decode": ROLE,
            "router": router}
    return {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name}, "spec": spec}


def _ready(api, namespace: str, name: str) -> dict:
    tis = client.CustomObjectsApi(api).get_namespaced_custom_object(*GVP[:2], namespace, GVP[2], name)
    return next((c for c in (tis.get("status") or {}).get("conditions") or [] if c["type"] == "Ready"), {})


def _denied(api, namespace: str, name: str) -> dict:
    c = wait_until(lambda: (c := _ready(api, namespace, name)).get("reason") == "PolicyDenied" and c,
                   timeout=60, what=f"{namespace}/{name}: Ready False PolicyDenied")
    assert c["status"] == "False", c
    return c


def _children(api, namespace: str, name: str) -> dict[str, list[str]]:
    """Everything the operator could have made for `name`, by kind (labelled or named as its own)."""
    sel = f"tandem.dev/service={name}"
    apps, core, rbac = client.AppsV1Api(api), client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
    found = {
        "Deployment": apps.list_namespaced_deployment(namespace, label_selector=sel).items,
        "ServiceAccount": core.list_namespaced_service_account(namespace, label_selector=sel).items,
        "Role": rbac.list_namespaced_role(namespace).items,
        "RoleBinding": rbac.list_namespaced_role_binding(namespace).items,
    }
    return {kind: sorted(o.metadata.name for o in objs
                         if o.metadata.name.startswith(f"{name}-") or (o.metadata.labels or {}).get(
                             "tandem.dev/service") == name)
            for kind, objs in found.items()}


def test_a_named_router_account_needs_the_policy_and_a_foreign_router_image_is_refused(
        k8s, api, start_operator, chart_rbac, namespace):
    core = client.CoreV1Api(api)
    secure = f"{namespace[:54]}-default"  # no policy entry: the chart's secure default
    core.create_namespace({"metadata": {"name": secure, "labels": {"tandem.dev/test": "true"}}})
    try:
        values = {"policy": {"namespaces": {namespace: {"serviceAccounts": [ACCOUNT]}}}}
        env = {e["name"]: e.get("value") for e in operator_container(render(k8s.bin_dir / "helm", **values))["env"]}
        operator = start_operator("--policy", env["TANDEM_POLICY"], kubeconfig=chart_rbac().kubeconfig)
        for ns in (namespace, secure):
            core.create_namespaced_service_account(ns, {"metadata": {"name": ACCOUNT}})
        k8s.kubectl("apply", "-n", secure, "-f", "-", input=yaml.safe_dump(
            _body("named", {"serviceAccountName": ACCOUNT})))
        k8s.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump_all([
            _body("named", {"serviceAccountName": ACCOUNT}),
            _body("foreign", {"serviceAccountName": ACCOUNT, "image": {"repository": "evil.example/router"}})]))

        refused = _denied(api, secure, "named")
        for words in ("router.serviceAccountName", f"'{ACCOUNT}'", "none named",
                      f"policy.namespaces.{secure}.serviceAccounts"):
            assert words in refused["message"], refused["message"]

        binding = wait_until(lambda: _children(api, namespace, "named")["RoleBinding"] and
                             client.RbacAuthorizationV1Api(api).read_namespaced_role_binding("named-router", namespace),
                             timeout=60, what="the allowed service's router RoleBinding")
        assert [(s.kind, s.name, s.namespace) for s in binding.subjects] == [("ServiceAccount", ACCOUNT, namespace)]
        assert binding.role_ref.kind == "Role" and binding.role_ref.name == "named-router"
        allowed = wait_until(lambda: len((c := _children(api, namespace, "named"))["Deployment"]) == 3 and c,
                             timeout=60, what="the allowed service's three Deployments")
        assert allowed["ServiceAccount"] == [], "a named account replaces the one the operator would make"
        router = client.AppsV1Api(api).read_namespaced_deployment("named-router", namespace)
        assert router.spec.template.spec.service_account_name == ACCOUNT

        foreign = _denied(api, namespace, "foreign")
        for words in ("router.image.repository", "'evil.example/router'", f"policy.namespaces.{namespace}.images"):
            assert words in foreign["message"], foreign["message"]
        assert "serviceAccountName" not in foreign["message"], "the account is allowed here; only the image is not"

        # By now the operator has passed over the refused services again and again (resync every 2 s).
        nothing = {"Deployment": [], "ServiceAccount": [], "Role": [], "RoleBinding": []}
        assert _children(api, secure, "named") == nothing, "a refused spec binds and runs nothing"
        assert _children(api, namespace, "foreign") == nothing
        assert not rbac_denials(operator.log()), "the chart's RBAC lacks what the operator needs"
    finally:
        core.delete_namespace(secure, propagation_policy="Background")
