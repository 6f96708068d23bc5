"""hack/k8s-bins.sh sets the version variables as the upstream Makefiles do: the binaries report their
release, not a placeholder, and helm knows the Kubernetes version it renders for without a cluster."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bins() -> Path:
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    if not assets:
        pytest.skip("needs the Kubernetes binaries: run through `make test` (KUBEBUILDER_ASSETS)")
    return Path(assets)


def _pinned(name: str) -> str:
    text = (REPO / "hack" / "k8s-bins.sh").read_text()
    return re.search(rf"^{name}=(v[0-9.]+)", text, re.M).group(1)


def _run(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60).stdout


def test_kubernetes_binaries_report_the_pinned_release(bins: Path) -> None:
    version = json.loads(_run(str(bins / "kubectl"), "version", "--client", "-o", "json"))["clientVersion"]
    assert version["gitVersion"] == _pinned("K8S_VERSION")
    assert version["gitTreeState"] == "clean" and "$Format" not in version["gitCommit"]
    assert _run(str(bins / "kube-apiserver"), "--version").strip() == f"Kubernetes {_pinned('K8S_VERSION')}"


def test_helm_renders_the_chart_without_being_told_the_kubernetes_version(bins: Path) -> None:
    assert f'Version:"{_pinned("HELM_VERSION")}"' in _run(str(bins / "helm"), "version")
    # The chart requires kubeVersion >= 1.29; a helm without its version ldflags assumes v1.20.
    out = subprocess.run([str(bins / "helm"), "template", "rel", str(REPO / "charts" / "tandem")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "kind: Deployment" in out.stdout
