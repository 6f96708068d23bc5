"""Kubernetes discovery never writes its bearer token to the log, on any error path: the API server
refusing the token (401), refusing the ServiceAccount (403: no RBAC), or not answering at all
(connection refused). Against the real test control plane; the pod watch fails and is logged, and
the token is nowhere in the log."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from pathlib import Path

import pytest
import yaml
from kubernetes import config as kube_config
from tandem.router.discovery.kubernetes import KubernetesDiscovery

pytestmark = [pytest.mark.cluster]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _watch_fails(kubeconfig: Path, namespace: str, caplog) -> None:
    """Run discovery with that kubeconfig until it has logged a failed watch."""
    api = kube_config.new_client_from_config(config_file=str(kubeconfig))
    api.configuration.retries = 0  # a refused connection fails at once
    disc = KubernetesDiscovery(api, namespace, "svc", lambda targets: None, request_timeout_s=5)
    disc.start(asyncio.get_running_loop())
    try:
        deadline = time.monotonic() + 30
        while "pod watch failed" not in caplog.text:
            assert time.monotonic() < deadline, "discovery never reported the failure"
            await asyncio.sleep(0.1)
    finally:
        disc.stop()
        api.close()


@pytest.mark.parametrize("case", ["unknown_token", "no_rbac", "unreachable"])
async def test_a_failing_discovery_never_logs_its_token(k8s, namespace, tmp_path, caplog, case):
    caplog.set_level(logging.DEBUG)
    if case == "unknown_token":
        token = "not-a-token-" + "x" * 40
    else:  # a real ServiceAccount's token: the namespace's default account has no role
        token = k8s.kubectl("create", "token", "default", "-n", namespace).stdout.strip()
    kubeconfig = k8s.kubeconfig_for_token(token, tmp_path / "kubeconfig")
    if case == "unreachable":
        doc = yaml.safe_load(kubeconfig.read_text())
        doc["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{_closed_port()}"
        kubeconfig.write_text(yaml.safe_dump(doc))
    await _watch_fails(kubeconfig, namespace, caplog)
    assert token not in caplog.text
    assert token[-20:] not in caplog.text
