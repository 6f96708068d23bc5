"""Fixtures for the Helm chart's tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def helm_bin() -> Path:
    """helm built by hack/k8s-bins.sh (or from $KUBEBUILDER_ASSETS); a missing binary errors
    with the command that builds it."""
    from tandem.testing.cluster import find_bin_dir

    return find_bin_dir(("helm",)) / "helm"
