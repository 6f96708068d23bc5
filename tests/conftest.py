"""Shared fixtures for the whole suite; each engineer's block is kept separate."""

from __future__ import annotations

from pathlib import Path

import pytest

# --- toy model (engineer C: model runtime) -----------------------------------------------------


@pytest.fixture(scope="session")
def toy_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama model + tokenizer in Hugging Face format, built once per session."""
    from tandem.worker.local.toy_model import make_toy_model

    return make_toy_model(tmp_path_factory.getbasetemp() / "toy-llama")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory):
    """tiny_model(arch) -> a tiny random-weight model of that architecture (testing/tiny_models.py),
    built once per session and shared by every test that asks for it."""
    from tandem.testing.tiny_models import make_tiny_model

    return lambda arch: make_tiny_model(arch, tmp_path_factory.getbasetemp() / f"tiny-{arch}")


# --- end toy model -----------------------------------------------------------------------------

# --- control plane (engineer A: tandem.testing.cluster) ----------------------------------------


@pytest.fixture(scope="session")
def k8s():
    """A real control plane (etcd, kube-apiserver, controller-manager, scheduler, KWOK nodes),
    started once per session; or the user's cluster when TANDEM_TEST_KUBECONFIG is set."""
    from tandem.testing.cluster import Cluster

    cluster = Cluster.from_env()
    cluster.start()  # raises ClusterError saying "run make test / hack/k8s-bins.sh" if bins are missing
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def namespace(k8s, request: pytest.FixtureRequest):
    """A fresh namespace (with its `default` ServiceAccount ready), deleted after the test."""
    import re
    import secrets

    from kubernetes import client
    from tandem.testing.cluster import wait_until

    base = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"t-{base}-{secrets.token_hex(3)}"
    with k8s.api_client() as api:
        core = client.CoreV1Api(api)
        core.create_namespace({"metadata": {"name": name, "labels": {"tandem.dev/test": "true"}}})
        try:
            # Pods are refused until the serviceaccount controller has made `default`.
            wait_until(
                lambda: core.read_namespaced_service_account("default", name),
                timeout=60,
                what=f"ServiceAccount {name}/default",
            )
            yield name
        finally:
            core.delete_namespace(name, propagation_policy="Background")


@pytest.fixture(scope="session")
def helm_bin() -> Path:
    """helm built by hack/k8s-bins.sh (or from $KUBEBUILDER_ASSETS); a missing binary errors
    with the command that builds it."""
    from tandem.testing.k8s_bins import find_bin_dir

    return find_bin_dir(("helm",)) / "helm"


# --- end control plane -------------------------------------------------------------------------


def _nixl_available() -> bool:
    try:
        from tandem.worker.kv import nixl  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(params=["tcp", pytest.param("nixl", marks=pytest.mark.nixl)])
def backend(request: pytest.FixtureRequest) -> str:
    """Every cross-process test runs over both network backends."""
    if request.param == "nixl" and not _nixl_available():
        pytest.skip("needs the nixl package (nixl-cu12, installed by `make venv`)")
    return request.param
