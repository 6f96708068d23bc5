"""Fixtures for the operator's tests: the CRD as the API server would default it, specs, examples."""

from __future__ import annotations

import copy
import os
import secrets
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from tandem.operator.spec import InferenceServiceSpec
from tandem.testing.pod_workers import ProcessGroup
from tandem.testing.rbac import rbac_md_rules

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "inferenceservices.tandem.dev.yaml"
EXAMPLES = ROOT / "examples"
RBAC_MD = ROOT / "operator" / "RBAC.md"


def _apply_defaults(schema: dict, value: Any) -> Any:
    """The API server's defaulting: a missing property gets its `default`, recursively."""
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = _apply_defaults(sub, value[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in value:
                value[key] = _apply_defaults(extra, value[key])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_apply_defaults(schema["items"], v) for v in value]
    return value


@pytest.fixture(scope="session")
def crd() -> dict:
    return yaml.safe_load(CRD_PATH.read_text())


@pytest.fixture(scope="session")
def spec_schema(crd: dict) -> dict:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


@pytest.fixture
def defaulted(spec_schema: dict) -> Callable[[dict], dict]:
    """spec -> the spec as stored by the API server after CRD defaulting."""
    return lambda spec: _apply_defaults(spec_schema, copy.deepcopy(spec))


@pytest.fixture
def typed(defaulted: Callable[[dict], dict]) -> Callable[[dict], InferenceServiceSpec]:
    """spec -> the typed spec the operator parses from what the API server stored."""
    return lambda spec: InferenceServiceSpec.from_dict(defaulted(spec))


@pytest.fixture
def meta() -> dict:
    return {"name": "llama", "namespace": "serving", "uid": "0b5e7a4c-1111-2222-3333-444455556666", "generation": 1}


@pytest.fixture(scope="session")
def examples() -> dict[str, dict]:
    """examples/*.yaml by file stem."""
    return {p.stem: yaml.safe_load(p.read_text()) for p in sorted(EXAMPLES.glob("*.yaml"))}


# --- against the real control plane ------------------------------------------------------------

CRD_NAME = "inferenceservices.tandem.dev"


@pytest.fixture(scope="session")
def crd_installed(k8s) -> str:
    """The CRD applied (server-side, so a later edit of the file updates it) and Established."""
    return k8s.apply_crd(CRD_PATH, CRD_NAME)


class OperatorProcess:
    """`tandem operator` as a real subprocess, with its log file and liveness URL."""

    def __init__(self, proc: subprocess.Popen, log_path: Path, liveness: str) -> None:
        self.proc, self.log_path, self.liveness = proc, log_path, liveness

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        """SIGTERM (kopf's graceful stop), then SIGKILL: never leaves a process behind."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def start_operator(k8s, crd_installed, tmp_path_factory):
    """Starts operators (all namespaces unless extra args name one, resync every 2 s, JSON logs;
    as the admin unless given a kubeconfig); stops them all at the end."""
    from tandem.testing.cluster import free_port, wait_until

    started: list[OperatorProcess] = []

    def start(*extra: str, kubeconfig: Path | None = None) -> OperatorProcess:
        port = free_port()
        liveness = f"http://127.0.0.1:{port}/healthz"
        log_path = tmp_path_factory.mktemp("operator") / "operator.log"
        scope = [] if "--namespace" in extra else ["--all-namespaces"]
        argv = [
            str(Path(sys.executable).parent / "tandem"), "operator", *scope,
            "--resync-seconds", "2", "--log-format", "json", "--liveness", liveness,
            "--worker-image", "registry.test/tandem-worker:test", *extra,
        ]
        env = dict(os.environ, KUBECONFIG=str(kubeconfig or k8s.kubeconfig))
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        op = OperatorProcess(proc, log_path, liveness)
        started.append(op)

        def alive() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"tandem operator exited with {proc.returncode}:\n{op.log()[-3000:]}")
            with urllib.request.urlopen(liveness, timeout=2) as resp:
                return resp.status == 200

        try:
            wait_until(alive, timeout=60, what="tandem operator liveness")
        except TimeoutError as e:
            raise AssertionError(f"{e}\n{op.log()[-3000:]}") from None
        return op

    try:
        yield start
    finally:
        for op in started:
            op.stop()


@pytest.fixture(scope="session")
def documented_rules() -> list[dict]:
    """operator/RBAC.md's table of what the operator always needs."""
    return rbac_md_rules(RBAC_MD)


@dataclass(frozen=True)
class ChartRBAC:
    """The chart's ServiceAccount as a kubeconfig, and the Lease its leader-election Role names."""

    kubeconfig: Path
    lease: str
    namespace: str = "default"
    account: str = ""  # the ServiceAccount's name

    @property
    def user(self) -> str:
        """Who the API server (and its audit log) says made the operator's calls."""
        return f"system:serviceaccount:{self.namespace}:{self.account}"

    def election(self, duration_s: int = 4) -> list[str]:
        """`tandem operator` flags for leader election on that Lease (short timings for tests)."""
        return ["--leader-election", "--leader-election-namespace", self.namespace, "--leader-election-name",
                self.lease, "--lease-duration-seconds", str(duration_s),
                "--lease-renew-deadline-seconds", str(duration_s - 1), "--lease-retry-seconds", "1"]


@pytest.fixture(scope="module")
def chart_rbac(k8s, tmp_path_factory):
    """chart_rbac(**values) -> ChartRBAC: the Helm chart's own ServiceAccount, bound by exactly the
    RBAC the chart renders with those values (release namespace `default`); removed at the end."""
    from tandem.testing.chart import find, render

    made: list[list[dict]] = []

    def install(**values) -> ChartRBAC:
        release = f"rbac{secrets.token_hex(3)}"
        objs = render(k8s.bin_dir / "helm", release=release, namespace="default", **values)
        rbac = [o for o in objs if o["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role",
                                                 "RoleBinding")]
        made.append(rbac)
        k8s.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(rbac))
        (sa,) = find(rbac, "ServiceAccount")
        token = k8s.kubectl("create", "token", sa["metadata"]["name"], "-n", "default",
                            "--duration=1h").stdout.strip()
        path = k8s.kubeconfig_for_token(token, tmp_path_factory.mktemp("chart-rbac") / "operator.kubeconfig")
        return ChartRBAC(path, f"{release}-tandem-operator", account=sa["metadata"]["name"])

    try:
        yield install
    finally:
        for rbac in made:
            k8s.kubectl("delete", "--ignore-not-found", "--wait=false", "-f", "-", input=yaml.safe_dump_all(rbac),
                        check=False)


@pytest.fixture(scope="module")
def api(k8s):
    """An API client on the test control plane, as cluster-admin."""
    with k8s.api_client() as api:
        yield api


@pytest.fixture
def procs(api):
    """Worker and router processes standing in for a service's pods (they get its internal secret, as
    its pods would); stopped after the test."""
    group = ProcessGroup(api)
    try:
        yield group
    finally:
        group.stop()
