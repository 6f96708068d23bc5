"""The chart's RBAC grants exactly the operator's calls: cluster-wide by default, per watched
namespace when asked, never a wildcard, a Secret read (but the hub tokens named in the values),
a pod made, removed or changed (issue 21.7: `pods: patch` only where the planner is allowed to mark
the pods a scale-down removes, a Role per named namespace, never cluster-wide), or a delete but of a
worker role's own workload when it changes kind (a Deployment <-> a LeaderWorkerSet). (That nothing
is missing is proved by the end-to-end tests, which run the operator with these rules.)"""

from __future__ import annotations

from pathlib import Path

from tandem.testing.chart import CHART_DIR, find, render, run_helm, set_json_args

# (apiGroup, resource) -> verbs: the operator's calls (operator/api_client.py) and watches
# (operator/watch.py, through kopf): every kind it applies is watched, by label.
EXPECTED = {
    ("tandem.dev", "inferenceservices"): {"get", "list", "watch"},  # kopf writes nothing on them
    ("tandem.dev", "inferenceservices/status"): {"patch"},
    # server-side apply: PATCH, plus `create` when the PATCH creates the object
    ("apps", "deployments"): {"get", "list", "watch", "create", "patch", "delete"},
    ("leaderworkerset.x-k8s.io", "leaderworkersets"): {"get", "list", "watch", "create", "patch", "delete"},
    ("", "services"): {"get", "list", "watch", "create", "patch"},
    ("", "configmaps"): {"get", "list", "watch", "create", "patch"},
    ("", "serviceaccounts"): {"get", "list", "watch", "create", "patch"},
    ("rbac.authorization.k8s.io", "roles"): {"get", "list", "watch", "create", "patch"},
    ("rbac.authorization.k8s.io", "rolebindings"): {"get", "list", "watch", "create", "patch"},
    ("networking.k8s.io", "networkpolicies"): {"get", "list", "watch", "create", "patch"},
    ("policy", "poddisruptionbudgets"): {"get", "list", "watch", "create", "patch"},
    # spec.gateway: the pool and its route (kinds of the user's gateway, watched once they exist)
    ("inference.networking.k8s.io", "inferencepools"): {"get", "list", "watch", "create", "patch"},
    ("gateway.networking.k8s.io", "httproutes"): {"get", "list", "watch", "create", "patch"},
    # a hub model's shared cache; a model.pvc claim read to judge its access modes
    ("", "persistentvolumeclaims"): {"get", "list", "watch", "create", "patch"},
    # its download, once per commit; watched: ModelReady follows the Job
    ("batch", "jobs"): {"get", "list", "watch", "create", "patch"},
    ("", "secrets"): {"create"},  # each service's internal secret, created once; never read
    ("", "pods"): {"get", "list", "watch"},
    # the owner chain of the pods the operator trusts (and the router's Role grants the same)
    ("apps", "replicasets"): {"get", "list", "watch"},
    ("apps", "statefulsets"): {"get"},
    ("discovery.k8s.io", "endpointslices"): {"get", "list", "watch"},
    ("", "events"): {"create"},
}
# The only kinds the operator deletes: a role's workload of the kind it no longer uses.
WORKLOADS = {"deployments", "leaderworkersets"}
FRAMEWORK = {("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"}}
LEASE = {("coordination.k8s.io", "leases"): {"get", "update", "create"}}


def election_roles(objs: list[dict]) -> list[dict]:
    return [r for r in find(objs, "Role") if r["metadata"]["name"].endswith("-leader-election")]


def grants(role: dict) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
        assert "*" not in rule["apiGroups"], rule
        # Only the Lease is named: get/update of that one object (create cannot be limited by name).
        assert not rule.get("resourceNames") or rule["resources"] == ["leases"], rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def bound_subjects(binding: dict) -> list[tuple[str, str, str]]:
    return [(s["kind"], s["name"], s.get("namespace", "")) for s in binding["subjects"]]


def test_cluster_wide_by_default(helm_bin: Path) -> None:
    objs = render(helm_bin, release="rel", namespace="ops")
    roles = {r["metadata"]["name"]: grants(r) for r in find(objs, "ClusterRole")}
    assert roles == {
        "rel-tandem-operator-ops": EXPECTED,
        "rel-tandem-operator-ops-framework": FRAMEWORK,
    }
    (lease,) = election_roles(objs)
    assert lease["metadata"]["namespace"] == "ops" and grants(lease) == LEASE
    named = [r for r in lease["rules"] if r.get("resourceNames")]
    assert named == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "update"],
                      "resourceNames": ["rel-tandem-operator"]}]
    assert find(objs, "Role") == [lease] and len(find(objs, "RoleBinding")) == 1
    for binding in find(objs, "ClusterRoleBinding"):
        assert binding["roleRef"]["kind"] == "ClusterRole"
        assert binding["roleRef"]["name"] == binding["metadata"]["name"]
        assert bound_subjects(binding) == [("ServiceAccount", "rel-tandem-operator", "ops")]


def test_watched_namespaces_get_roles_and_nothing_cluster_wide_but_discovery(
    helm_bin: Path,
) -> None:
    objs = render(helm_bin, release="rel", namespace="ops", watchNamespaces=["llm-a", "llm-b"])
    (framework,) = find(objs, "ClusterRole")
    assert grants(framework) == FRAMEWORK | {("", "namespaces"): {"list", "watch"}}
    roles = [r for r in find(objs, "Role") if r not in election_roles(objs)]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["llm-a", "llm-b"]
    for role in roles:
        assert grants(role) == EXPECTED
    bindings = [b for b in find(objs, "RoleBinding") if not b["metadata"]["name"].endswith("-leader-election")]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["llm-a", "llm-b"]
    for binding in bindings:
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                      "name": "rel-tandem-operator"}
        assert bound_subjects(binding) == [("ServiceAccount", "rel-tandem-operator", "ops")]


def test_nothing_beyond_the_operators_calls(helm_bin: Path) -> None:
    for role in find(render(helm_bin), "ClusterRole"):
        for (_group, resource), verbs in grants(role).items():
            if resource == "secrets":
                assert verbs == {"create"}  # never get, list or watch: no Secret is ever read
            if resource not in WORKLOADS:
                assert "delete" not in verbs
            assert "deletecollection" not in verbs
            assert not {"escalate", "bind", "impersonate"} & verbs
            if resource == "pods":
                assert verbs == {"get", "list", "watch"}  # never makes, changes or removes pods


def test_rbac_can_be_left_to_the_user(helm_bin: Path) -> None:
    objs = render(helm_bin, **{"rbac.create": False})
    assert not [o for o in objs if o["apiVersion"].startswith("rbac.authorization.k8s.io")]


def test_marking_pods_for_removal_is_a_role_per_named_namespace(helm_bin: Path) -> None:
    """`pods: patch` cannot be limited to annotations by RBAC: it is granted only where asked."""
    values = {"autoscaling.markPodsForRemoval.enabled": True,
              "autoscaling.markPodsForRemoval.namespaces": ["llm-a"]}
    objs = render(helm_bin, release="rel", namespace="ops", **values)
    for role in find(objs, "ClusterRole"):
        assert "patch" not in grants(role).get(("", "pods"), set()), "pods: patch cluster-wide"
    (marker,) = [r for r in find(objs, "Role") if ("", "pods") in grants(r)]
    assert marker["metadata"]["namespace"] == "llm-a" and grants(marker) == {("", "pods"): {"patch"}}
    (binding,) = [b for b in find(objs, "RoleBinding") if b["roleRef"]["name"] == marker["metadata"]["name"]]
    assert binding["metadata"]["namespace"] == "llm-a"
    assert bound_subjects(binding) == [("ServiceAccount", "rel-tandem-operator", "ops")]
    args = find(objs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--mark-pods-for-removal" in args
    assert "--mark-pods-for-removal" not in find(render(helm_bin), "Deployment")[0]["spec"]["template"][
        "spec"]["containers"][0]["args"], "off by default"


def test_marking_follows_the_watched_namespaces_and_is_never_cluster_wide(helm_bin: Path) -> None:
    objs = render(helm_bin, release="rel", namespace="ops", watchNamespaces=["llm-a", "llm-b"],
                  **{"autoscaling.markPodsForRemoval.enabled": True})
    markers = [r for r in find(objs, "Role") if grants(r) == {("", "pods"): {"patch"}}]
    assert sorted(r["metadata"]["namespace"] for r in markers) == ["llm-a", "llm-b"]
    proc = run_helm(helm_bin, "template", "rel", str(CHART_DIR), "--namespace", "ops",
                    *set_json_args({"autoscaling.markPodsForRemoval.enabled": True}), check=False)
    assert proc.returncode != 0 and "markPodsForRemoval.namespaces" in proc.stderr, proc.stderr


def test_hub_token_secrets_are_read_by_name_only(helm_bin: Path) -> None:
    """With hub.tokenSecrets the operator may `get` exactly those Secrets, nothing else of them."""
    objs = render(helm_bin, release="rel", namespace="ops", **{"hub.tokenSecrets": ["hf-token", "hf-other"]})
    (role,) = [r for r in find(objs, "ClusterRole") if not r["metadata"]["name"].endswith("framework")]
    named = [r for r in role["rules"] if r.get("resourceNames")]
    assert named == [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["hf-token", "hf-other"],
                      "verbs": ["get"]}]
    others = [r for r in role["rules"] if "secrets" in r["resources"] and not r.get("resourceNames")]
    assert [r["verbs"] for r in others] == [["create"]]
