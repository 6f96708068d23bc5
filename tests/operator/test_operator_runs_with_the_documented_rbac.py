"""operator/RBAC.md is honest: the operator does its whole job with exactly the rules it lists.

The table in RBAC.md is parsed into a ClusterRole (conftest's documented_rules); the operator runs as a ServiceAccount bound
to it (a real token, real RBAC in the API server) and must reconcile to Ready without a single
Forbidden in its log.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
import yaml
from kubernetes import client
from tandem.testing.cluster import wait_until
from tandem.testing.k8s_events import wait_events
from tandem.testing.rbac import rbac_denials, rbac_md_rules

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
RBAC_MD = Path(__file__).resolve().parents[2] / "operator" / "RBAC.md"

def _grants(rules: list[dict]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


# Documented, not granted by the chart: only where the OwnerReferencesPermissionEnforcement admission
# plugin is on (RBAC.md says when to add it).
NOT_IN_CHART = {("tandem.dev", "inferenceservices/finalizers", "update")}


def test_the_tables_are_the_charts_rules(helm_bin):
    """What RBAC.md says and what the chart grants are the same rules, section by section."""
    from tandem.testing.chart import find, render

    def granted(objs: list[dict], kinds: tuple[str, ...]) -> set[tuple[str, str, str]]:
        return _grants([rule for o in objs if o["kind"] in kinds for rule in o["rules"]])

    cluster = render(helm_bin, watchNamespaces=["a"])
    election = [r for r in find(cluster, "Role") if r["metadata"]["name"].endswith("-leader-election")]
    others = [o for o in cluster if o not in election]
    always = rbac_md_rules(RBAC_MD, "Always")
    assert granted(others, ("ClusterRole", "Role")) == _grants(always) - NOT_IN_CHART
    assert granted(election, ("Role",)) == _grants(rbac_md_rules(RBAC_MD, "Leader election"))
    marking = render(helm_bin, **{"autoscaling.markPodsForRemoval.enabled": True,
                                  "autoscaling.markPodsForRemoval.namespaces": ["a"]})
    markers = [r for r in find(marking, "Role") if r["metadata"]["name"].endswith("-pod-marker")]
    assert granted(markers, ("Role",)) == _grants(rbac_md_rules(RBAC_MD, "Only with `--mark-pods-for-removal`"))
    assert ("", "pods", "patch") not in _grants(always)


def test_the_table_parses_into_rules(documented_rules):
    rules = documented_rules
    groups = {r["apiGroups"][0] for r in rules}
    assert {"tandem.dev", "apps", "", "rbac.authorization.k8s.io"} <= groups
    assert not any("*" in r["verbs"] for r in rules)
    # deletes only a worker role's workload of the kind it no longer uses (Deployment <-> LeaderWorkerSet)
    deletes = {res for r in rules if "delete" in r["verbs"] for res in r["resources"]}
    assert deletes == {"deployments", "leaderworkersets"}
    core = {res for r in rules if r["apiGroups"] == [""] for res in r["resources"]}
    assert {"pods", "services", "configmaps", "serviceaccounts", "events"} <= core


CLUSTER_SCOPED = {"customresourcedefinitions", "namespaces"}


@pytest.mark.parametrize("scope", ["all-namespaces", "one-namespace"])
def test_operator_reconciles_with_only_the_documented_rules(k8s, start_operator, namespace, tmp_path, scope,
                                                            documented_rules):
    """all-namespaces: a ClusterRole with every row. one-namespace: `--namespace NS` and only a
    Role in NS without the optional cluster-scoped rows, as RBAC.md says is enough."""
    suffix = secrets.token_hex(3)
    sa_ns, name = namespace, f"tandem-operator-{suffix}"
    cluster = scope == "all-namespaces"
    rules = documented_rules
    if not cluster:
        rules = [r for r in rules if not set(r["resources"]) & CLUSTER_SCOPED]
    kind = "ClusterRole" if cluster else "Role"
    meta = {"name": name} if cluster else {"name": name, "namespace": namespace}
    objs = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": sa_ns}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": kind, "metadata": meta, "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": f"{kind}Binding", "metadata": meta,
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": sa_ns}]},
    ]
    k8s.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objs))
    try:
        token = k8s.kubectl("create", "token", name, "-n", sa_ns, "--duration=1h").stdout.strip()
        kubeconfig = k8s.kubeconfig_for_token(token, tmp_path / "operator.kubeconfig")
        op = start_operator(*([] if cluster else ["--namespace", namespace]), kubeconfig=kubeconfig)
        tis = {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": "rbac"},
               "spec": {"model": {"path": "/m"},
                        "prefill": {"gpus": 0, "cpu": "100m", "nodeSelector": {"tandem.dev/pool": "cpu"}},
                        "decode": {"gpus": 0, "cpu": "100m", "nodeSelector": {"tandem.dev/pool": "cpu"}},
                        "kvTransfer": {"backend": "tcp"}}}
        k8s.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(tis))
        with k8s.api_client() as api:
            objs_api = client.CustomObjectsApi(api)

            def ready():
                t = objs_api.get_namespaced_custom_object("tandem.dev", "v1alpha1", namespace,
                                                          "inferenceservices", "rbac")
                conds = {c["type"]: c for c in (t.get("status") or {}).get("conditions") or []}
                return conds.get("Ready", {}).get("status") == "True"

            try:
                wait_until(ready, timeout=90, what="rbac Ready=True under the documented RBAC")
            except TimeoutError as e:
                raise AssertionError(f"{e}\noperator log:\n{op.log()[-4000:]}") from None
            # a drift correction needs the same rights: delete a child and see it come back
            client.AppsV1Api(api).delete_namespaced_deployment("rbac-router", namespace)
            wait_until(lambda: client.AppsV1Api(api).read_namespaced_deployment("rbac-router", namespace),
                       timeout=30, what="router Deployment restored")
            # the trust boundary: the internal Secret (created, never read: create-only rights) and
            # the NetworkPolicy; a lost Secret is created again with a fresh value
            core = client.CoreV1Api(api)
            first = core.read_namespaced_secret("rbac-internal", namespace)
            assert first.metadata.owner_references[0].name == "rbac"
            assert len(first.data["secret"]) >= 32
            client.NetworkingV1Api(api).read_namespaced_network_policy("rbac-workers", namespace)
            core.delete_namespaced_secret("rbac-internal", namespace)
            again = wait_until(lambda: core.read_namespaced_secret("rbac-internal", namespace),
                               timeout=30, what="internal Secret created again")
            assert again.data["secret"] != first.data["secret"]
            wait_events(api, namespace, "rbac", lambda e: e.reason == "Created", "a Created event")
        if cluster:
            denied = rbac_denials(op.log())
            assert not denied, "the operator hit missing permissions:\n" + "\n".join(denied)
        op.stop()
    finally:
        if cluster:
            k8s.kubectl("delete", "clusterrolebinding,clusterrole", name, "--ignore-not-found", check=False)
