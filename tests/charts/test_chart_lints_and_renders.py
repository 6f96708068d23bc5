"""`helm lint --strict` and `helm template` are clean for the default values and for every
optional part switched on, and the values schema refuses bad input with a clear message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tandem.testing.chart import CHART_DIR, find, render, run_helm, set_json_args

ALL_ON = {
    "monitoring.podMonitor.enabled": True,
    "grafanaDashboard.enabled": True,
    "watchNamespaces": ["llm-a", "llm-b"],
    "operator.nodeSelector": {"kubernetes.io/os": "linux"},
    "operator.tolerations": [{"key": "dedicated", "operator": "Exists"}],
    "operator.extraEnv": [{"name": "EXTRA", "value": "1"}],
}


@pytest.mark.parametrize("values", [{}, ALL_ON], ids=["defaults", "everything-on"])
def test_helm_lint_strict_is_clean(helm_bin: Path, values: dict) -> None:
    proc = run_helm(helm_bin, "lint", "--strict", str(CHART_DIR), *set_json_args(values))
    assert "0 chart(s) failed" in proc.stdout, proc.stdout
    # --strict turns warnings into failures; also refuse the info-level "icon is recommended"
    # kind of noise only if it were an error: what is left must be INFO at most.
    assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout, proc.stdout


def test_default_install_renders_the_operator_and_its_rbac(helm_bin: Path) -> None:
    objs = render(helm_bin)
    kinds = sorted(o["kind"] for o in objs)
    assert kinds == sorted([
        "ServiceAccount", "Service", "Deployment", "Pod",  # Pod: the `helm test` hook
        "ClusterRole", "ClusterRoleBinding",  # the operator's rules, every namespace
        "ClusterRole", "ClusterRoleBinding",  # kopf's CRD scanning
        "Role", "RoleBinding",  # leader election: the Lease in the release namespace
    ])
    for obj in objs:
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == "rel"
        assert labels["app.kubernetes.io/part-of"] == "tandem"
        if obj["kind"] not in ("ClusterRole", "ClusterRoleBinding"):
            assert obj["metadata"]["namespace"] == "tandem-system", obj["metadata"]
    # Optional parts are off by default: the Prometheus Operator CRDs may not exist.
    assert not find(objs, "PodMonitor") and not find(objs, "ConfigMap")


def test_optional_parts_render_when_enabled(helm_bin: Path) -> None:
    objs = render(helm_bin, **ALL_ON)
    monitors = {m["metadata"]["name"]: m for m in find(objs, "PodMonitor")}
    assert sorted(monitors) == ["rel-tandem-operator", "rel-tandem-workloads"]
    operator = monitors["rel-tandem-operator"]["spec"]
    assert operator["namespaceSelector"] == {"matchNames": ["tandem-system"]}
    assert operator["selector"]["matchLabels"]["app.kubernetes.io/component"] == "operator"
    (endpoint,) = operator["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["honorLabels"]) == ("health", "/metrics", True)
    monitor = [monitors["rel-tandem-workloads"]]
    spec = monitor[0]["spec"]
    assert spec["namespaceSelector"] == {"matchNames": ["llm-a", "llm-b"]}
    relabel = {r["targetLabel"]: r["sourceLabels"] for r in spec["podMetricsEndpoints"][0]["relabelings"]}
    assert relabel["inferenceservice"] == ["__meta_kubernetes_pod_label_tandem_dev_service"]
    assert relabel["role"] == ["__meta_kubernetes_pod_label_tandem_dev_role"]
    (dashboard,) = find(objs, "ConfigMap")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["tandem.json"])["uid"] == "tandem-overview"


def test_grafana_dashboard_can_go_to_grafanas_namespace(helm_bin: Path) -> None:
    objs = render(helm_bin, **{"grafanaDashboard.enabled": True,
                               "grafanaDashboard.namespace": "monitoring"})
    (dashboard,) = find(objs, "ConfigMap")
    assert dashboard["metadata"]["namespace"] == "monitoring"


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("operator.healthPort", "80", "/operator/healthPort"),
        ("operator.image.pullPolicy", '"Sometimes"', "/operator/image/pullPolicy"),
        ("operator.logFormat", '"xml"', "/operator/logFormat"),
        ("watchNamespaces", '["Not_A_Namespace"]', "/watchNamespaces/0"),
        ("workerDefaults.image.repository", '""', "/workerDefaults/image/repository"),
        ("operatr", "{}", "operatr"),
        ("monitoring.podMonitor.interval", '"15 seconds"', "interval"),
    ],
)
def test_values_schema_refuses_bad_values(helm_bin: Path, key: str, value: str, message: str) -> None:
    proc = run_helm(
        helm_bin, "template", "rel", str(CHART_DIR),
        "--set-json", f"{key}={value}", check=False,
    )
    assert proc.returncode != 0, f"{key}={value} was accepted:\n{proc.stdout[:500]}"
    assert "values don't meet the specifications of the schema" in proc.stderr, proc.stderr
    assert message in proc.stderr, proc.stderr


def test_service_account_can_be_brought_by_the_user(helm_bin: Path) -> None:
    proc = run_helm(
        helm_bin, "template", "rel", str(CHART_DIR),
        "--set", "serviceAccount.create=false", check=False,
    )
    assert proc.returncode != 0
    assert "serviceAccount.name is required" in proc.stderr
    objs = render(helm_bin, **{"serviceAccount.create": False, "serviceAccount.name": "mine"})
    assert not find(objs, "ServiceAccount")
    (deploy,) = find(objs, "Deployment")
    assert deploy["spec"]["template"]["spec"]["serviceAccountName"] == "mine"
    for binding in find(objs, "ClusterRoleBinding"):
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "mine", "namespace": "tandem-system"}
        ]
