"""Where the control plane's binaries are: $KUBEBUILDER_ASSETS, or the folder hack/k8s-bins.sh
builds them into (asked, never built, here)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

from tandem.testing import lws_controller
from tandem.testing.components import ClusterError

REPO_ROOT = Path(__file__).resolve().parents[1]
K8S_BINS_SCRIPT = REPO_ROOT / "hack" / "k8s-bins.sh"

CONTROL_PLANE_BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "kwok",
    "helm",
    "kwok-stages.yaml",
    *lws_controller.LWS_BINARIES,
)
CLIENT_BINARIES = ("kubectl", "helm")


def _missing(bin_dir: Path, names: Sequence[str]) -> list[str]:
    return [n for n in names if not (bin_dir / n).exists()]


def find_bin_dir(required: Sequence[str] = CONTROL_PLANE_BINARIES) -> Path:
    """The dir with the control-plane binaries: $KUBEBUILDER_ASSETS, else what
    `hack/k8s-bins.sh --print-dir` names (which never builds)."""
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    if assets and not _missing(Path(assets), required):
        return Path(assets)
    if not K8S_BINS_SCRIPT.exists():
        raise ClusterError(
            f"{K8S_BINS_SCRIPT} not found (tandem.testing is not installed from the repo); "
            f"set KUBEBUILDER_ASSETS to a dir holding {', '.join(required)}"
        )
    proc = subprocess.run(
        ["bash", str(K8S_BINS_SCRIPT), "--print-dir"], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise ClusterError(f"hack/k8s-bins.sh --print-dir failed: {proc.stderr.strip()}")
    bin_dir = Path(proc.stdout.strip())
    missing = _missing(bin_dir, required)
    if missing:
        raise ClusterError(
            f"control-plane binaries missing from {bin_dir}: {', '.join(missing)}; "
            "run `make test` or `hack/k8s-bins.sh` to build them (KUBEBUILDER_ASSETS="
            f"{assets or '<unset>'})"
        )
    return bin_dir

