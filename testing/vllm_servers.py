"""Real `vllm serve` processes on loopback for the router's vLLM runtime tests: a prefill and a decode
server paired by vLLM's NixlConnector (KV over UCX on loopback TCP) and a colocated one, each run
with the arguments Tandem renders for its role (tandem.contracts.vllm_serve.serve_args), every port
its own, started together (vLLM takes a minute or more to start) and stopped for sure."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from tandem.contracts.names import Role
from tandem.contracts.vllm_serve import ServeOptions, serve_args, serve_env
from tandem.worker.local.processes import ManagedProcess, Supervisor, free_port

START_S = 900.0  # a loaded 2-core machine starts three servers side by side: each compiles its model


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


def vllm_server(python: Path, model: Path, served_name: str, role: Role, cache: Path,
                cpu: int | None = None, max_model_len: int = 2048) -> VllmServer:
    """A server of `role` (not started), every port free now."""
    port, events = free_port(), free_port()
    args = serve_args(ServeOptions(model=str(model), served_name=served_name, role=role.value, port=port,
                                   host="127.0.0.1", max_model_len=max_model_len, kv_buffer_device="cpu",
                                   kv_events_port=events))
    env = dict(os.environ) | serve_env("127.0.0.1", free_port()) | {
        "UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CACHE_ROOT": str(cache), "VLLM_PORT": str(free_port()),
        "VLLM_NIXL_ABORT_REQUEST_TIMEOUT": "60",
    }
    if cpu is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu)
    argv = [str(python.parent / "vllm"), "serve", *args]
    process = ManagedProcess(f"vllm-{role.value}", argv, env=env, url=f"http://127.0.0.1:{port}", role=role.value)
    return VllmServer(process, role, process.url, f"tcp://127.0.0.1:{events}")


@dataclass
class VllmServers:
    """A prefill-decode pair and a colocated server of one model."""

    prefill: VllmServer
    decode: VllmServer
    colocated: VllmServer
    model_dir: Path
    served_name: str
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


def vllm_servers(python: Path, model: Path, workdir: Path, served_name: str = "toy") -> VllmServers:
    """The three servers (not started): prefill on core 0, decode on core 1, colocated unpinned."""
    cache = workdir / "vllm-cache"
    cache.mkdir(parents=True, exist_ok=True)
    servers = [vllm_server(python, model, served_name, role, cache, cpu)
               for role, cpu in ((Role.PREFILL, 0), (Role.DECODE, 1), (Role.COLOCATED, None))]
    return VllmServers(*servers, model_dir=model, served_name=served_name, supervisor=Supervisor())
