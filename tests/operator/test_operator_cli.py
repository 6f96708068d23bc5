"""`tandem operator`: flags over environment over defaults, and no heavy imports."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
from tandem.operator.cli import add_arguments, operator_config
from tandem.operator.config import OperatorConfig, split_image


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_flags_override_environment(monkeypatch):
    monkeypatch.setenv("TANDEM_WORKER_IMAGE", "env.registry/tandem:env")
    monkeypatch.setenv("TANDEM_IMAGE_PULL_POLICY", "Always")
    cfg = operator_config(_parse(["-A"]))
    assert (cfg.image_repository, cfg.image_tag, cfg.pull_policy) == ("env.registry/tandem", "env", "Always")
    cfg = operator_config(_parse(["-A", "--worker-image", "flag.registry:5000/t:v9",
                                  "--image-pull-policy", "Never", "--resync-seconds", "7"]))
    assert (cfg.image_repository, cfg.image_tag, cfg.pull_policy) == ("flag.registry:5000/t", "v9", "Never")
    assert cfg.resync_seconds == 7


def test_the_router_image_is_chosen_apart_from_the_workers(monkeypatch):
    monkeypatch.setenv("TANDEM_ROUTER_IMAGE", "env.registry/router:r1")
    cfg = operator_config(_parse(["-A", "--worker-image", "w.registry/worker:w1"]))
    assert (cfg.router_repository, cfg.router_tag) == ("env.registry/router", "r1")
    assert (cfg.image_repository, cfg.image_tag) == ("w.registry/worker", "w1")
    cfg = operator_config(_parse(["-A", "--router-image", "flag.registry/router@sha256:" + "a" * 64]))
    assert (cfg.router_repository, cfg.router_tag) == ("flag.registry/router", "@sha256:" + "a" * 64)
    monkeypatch.delenv("TANDEM_ROUTER_IMAGE")
    assert OperatorConfig.from_env({}).router_repository == "ghcr.io/tandem-dev/tandem-router"


def test_defaults_without_environment(monkeypatch):
    for var in ("TANDEM_WORKER_IMAGE", "TANDEM_ROUTER_IMAGE", "TANDEM_IMAGE_PULL_POLICY", "TANDEM_RESYNC_SECONDS",
                "TANDEM_KV_PROBE", "TANDEM_KV_PROBE_TIMEOUT_SECONDS", "TANDEM_METRICS_TIMEOUT_SECONDS",
                "POD_NAMESPACE", "TANDEM_OPERATOR_POD_LABELS"):
        monkeypatch.delenv(var, raising=False)
    assert operator_config(_parse(["-n", "a", "-n", "b"])) == OperatorConfig()


def test_kv_probe_is_on_by_default_and_can_be_turned_off(monkeypatch):
    monkeypatch.delenv("TANDEM_KV_PROBE", raising=False)
    monkeypatch.delenv("TANDEM_KV_PROBE_TIMEOUT_SECONDS", raising=False)
    cfg = operator_config(_parse(["-A"]))
    assert (cfg.kv_probe, cfg.kv_probe_timeout_s) == (True, 3.0)
    cfg = operator_config(_parse(["-A", "--no-kv-probe", "--kv-probe-timeout-seconds", "0.5"]))
    assert (cfg.kv_probe, cfg.kv_probe_timeout_s) == (False, 0.5)
    monkeypatch.setenv("TANDEM_KV_PROBE", "0")
    assert operator_config(_parse(["-A"])).kv_probe is False


def test_the_operator_pods_namespace_labels_and_metrics_timeout_come_through(monkeypatch):
    """The chart sets POD_NAMESPACE and the pod labels: the NetworkPolicy admits the operator (its
    KV probe and the planner's /metrics reads) only when they reach the config."""
    monkeypatch.setenv("POD_NAMESPACE", "tandem-system")
    monkeypatch.setenv("TANDEM_OPERATOR_POD_LABELS", '{"app.kubernetes.io/name": "tandem"}')
    monkeypatch.setenv("TANDEM_METRICS_TIMEOUT_SECONDS", "4")
    cfg = operator_config(_parse(["-A"]))
    assert cfg.namespace == "tandem-system" and cfg.pod_labels == (("app.kubernetes.io/name", "tandem"),)
    assert cfg.metrics_timeout_s == 4
    assert operator_config(_parse(["-A", "--metrics-timeout-seconds", "1.5"])).metrics_timeout_s == 1.5


def test_namespace_and_all_namespaces_exclude_each_other():
    with pytest.raises(SystemExit):
        _parse(["-A", "-n", "x"])


@pytest.mark.parametrize(("image", "split"), [
    ("repo", ("repo", "")),
    ("registry:5000/repo", ("registry:5000/repo", "")),
    ("registry:5000/repo:1.0", ("registry:5000/repo", "1.0")),
    ("repo@sha256:" + "a" * 64, ("repo", "@sha256:" + "a" * 64)),
])
def test_split_image(image, split):
    assert split_image(image) == split


def test_operator_modules_never_import_torch():
    code = ("import sys, tandem.operator.cli, tandem.operator.handlers; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    # the CLI table imports this module for --help: it must not even load kopf
    code = "import sys, tandem.operator.cli; assert 'kopf' not in sys.modules and 'kubernetes' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
