"""The operator Deployment: two replicas electing a leader on a Lease, rolled one pod at a time,
probed on its liveness endpoint, the worker defaults in its environment, and its pod (and the
`helm test` pod) at the Restricted Pod Security level."""

from __future__ import annotations

from pathlib import Path

import pytest
from tandem.testing.chart import find, operator_container, operator_deployment, render
from tandem.testing.pod_security import restricted_violations


def test_two_replicas_elect_a_leader_and_roll_one_at_a_time(helm_bin: Path) -> None:
    objs = render(helm_bin)
    spec = operator_deployment(objs)["spec"]
    assert spec["replicas"] == 2
    # Safe with the election: a new pod stands by until the old leader releases the Lease.
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    args = operator_container(objs)["args"]
    assert "--leader-election" in args and "--leader-election-name=rel-tandem-operator" in args
    assert "--lease-duration-seconds=15" in args and "--lease-renew-deadline-seconds=10" in args
    env = {e["name"]: e.get("valueFrom") for e in operator_container(objs)["env"]}
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    anti = spec["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert anti["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]["topologyKey"] == \
        "kubernetes.io/hostname", "the standby prefers another node"


def test_liveness_probe_hits_the_endpoint_the_operator_serves(helm_bin: Path) -> None:
    objs = render(helm_bin, **{"operator.healthPort": 9090})
    container = operator_container(objs)
    probe = container["livenessProbe"]["httpGet"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert probe == {"path": "/healthz", "port": "health"}
    assert ports["health"] == 9090
    assert "--liveness=http://0.0.0.0:9090/healthz" in container["args"]
    (svc,) = find(objs, "Service")
    assert svc["spec"]["ports"][0]["port"] == 9090


def test_operator_serves_all_namespaces_by_default(helm_bin: Path) -> None:
    args = operator_container(render(helm_bin))["args"]
    assert args[0] == "operator"
    assert "--all-namespaces" in args
    assert "--log-format=json" in args
    assert not [a for a in args if a.startswith("--namespace")]


def test_watch_namespaces_become_namespace_flags(helm_bin: Path) -> None:
    args = operator_container(render(helm_bin, watchNamespaces=["a", "b"]))["args"]
    assert "--all-namespaces" not in args
    assert [a for a in args if a.startswith("--namespace")] == ["--namespace=a", "--namespace=b"]


def test_worker_defaults_reach_the_operator(helm_bin: Path) -> None:
    objs = render(helm_bin, **{
        "workerDefaults.image.repository": "registry.example/tandem-worker",
        "workerDefaults.image.tag": "1.2.3",
        "workerDefaults.image.pullPolicy": "Always",
    })
    env = {e["name"]: e.get("value") for e in operator_container(objs)["env"]}
    assert env["TANDEM_WORKER_IMAGE"] == "registry.example/tandem-worker:1.2.3"
    assert env["TANDEM_ROUTER_IMAGE"] == "ghcr.io/tandem-dev/tandem-router:0.1.0", "its own image, by default"
    routed = render(helm_bin, **{"routerDefaults.image.repository": "registry.example/tandem-router",
                                 "routerDefaults.image.tag": "2.0"})
    routed_env = {e["name"]: e.get("value") for e in operator_container(routed)["env"]}
    assert routed_env["TANDEM_ROUTER_IMAGE"] == "registry.example/tandem-router:2.0"
    assert env["TANDEM_IMAGE_PULL_POLICY"] == "Always"
    assert env["TANDEM_RESYNC_SECONDS"] == "60"


def test_images_default_to_the_chart_app_version(helm_bin: Path) -> None:
    import yaml
    from tandem.testing.chart import CHART_DIR

    app_version = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())["appVersion"]
    container = operator_container(render(helm_bin))
    assert container["image"] == f"ghcr.io/tandem-dev/tandem-operator:{app_version}"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["TANDEM_WORKER_IMAGE"] == f"ghcr.io/tandem-dev/tandem-worker:{app_version}"


@pytest.mark.parametrize("which", ["operator", "helm-test"])
def test_pods_meet_the_restricted_level(helm_bin: Path, which: str) -> None:
    objs = render(helm_bin)
    if which == "operator":
        pod_spec = operator_deployment(objs)["spec"]["template"]["spec"]
    else:
        (pod,) = find(objs, "Pod")
        assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
        pod_spec = pod["spec"]
    assert restricted_violations(pod_spec) == []
    # Pinned field by field as well, beyond what Restricted strictly demands.
    pod_sc = pod_spec["securityContext"]
    assert pod_sc["runAsNonRoot"] is True
    assert pod_sc["runAsUser"] == 10001  # the uid the Dockerfile creates
    assert pod_sc["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod_spec["containers"]
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert "limits" in container["resources"] and "memory" in container["resources"]["limits"]


def test_restricted_check_catches_what_rdma_workers_need() -> None:
    """The checker itself is not vacuous: IPC_LOCK and hostNetwork break the level."""
    spec = {
        "hostNetwork": True,
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [{
            "name": "w",
            "securityContext": {"allowPrivilegeEscalation": False,
                                "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}},
        }],
        "volumes": [{"name": "dev", "hostPath": {"path": "/dev/infiniband"}}],
    }
    found = "\n".join(restricted_violations(spec))
    assert "hostNetwork" in found and "IPC_LOCK" in found and "hostPath" in found


@pytest.mark.parametrize("values", [{}, {"watchNamespaces": ["a", "b"], "operator.logFormat": "plain"}])
def test_rendered_args_are_accepted_by_tandem_operator(helm_bin: Path, values: dict) -> None:
    """The flags the chart passes are the ones `tandem operator` defines (its real parser)."""
    import argparse

    from tandem.operator.cli import add_arguments

    parser = argparse.ArgumentParser(prog="tandem operator", exit_on_error=False)
    add_arguments(parser)
    args = operator_container(render(helm_bin, **values))["args"]
    assert args[0] == "operator"
    parsed = parser.parse_args(args[1:])
    assert parsed.liveness == "http://0.0.0.0:8080/healthz"
    assert parsed.all_namespaces is (not values)
    assert parsed.namespace == values.get("watchNamespaces", [])
