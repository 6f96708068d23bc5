"""The one way a benchmark starts a process: tandem.worker.local.processes' ManagedProcess (own
process group, dies with us, optionally pinned to one core before exec, output to a log file) plus
what a benchmark reads from it (CPU seconds, per-thread CPU, placement).

Also the command lines of `tandem worker` and `tandem router` as the benchmarks run them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
from tandem.worker.local.processes import ManagedProcess, free_port

__all__ = ["BenchProcess", "free_port", "router_cmd", "router_process", "tandem_exe", "thread_env", "worker_cmd",
           "worker_process"]


def tandem_exe() -> list[str]:
    """The `tandem` console script of this interpreter's environment ($TANDEM_EXE overrides)."""
    if os.environ.get("TANDEM_EXE"):
        return [os.environ["TANDEM_EXE"]]
    exe = Path(sys.executable).with_name("tandem")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("tandem")
    if found:
        return [found]
    return [sys.executable, "-m", "tandem.cli.main"]


def thread_env(threads: int = 1) -> dict[str, str]:
    """`threads` compute threads: every library that might start a pool is told so."""
    n = str(threads)
    return dict(OMP_NUM_THREADS=n, MKL_NUM_THREADS=n, OPENBLAS_NUM_THREADS=n,
                TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")


class BenchProcess(ManagedProcess):
    """A benchmark's child: a ManagedProcess, with its log under the run's folder, and the CPU and
    placement it reports (pinning is checked, not assumed)."""

    def __init__(self, name: str, role: str, url: str, cmd: list[str], cpu: int | None, log_path: Path,
                 env: dict[str, str] | None = None):
        # name: "router", "prefill", "decode", "colocated-0", ...; role: router|prefill|decode|colocated
        log_path.parent.mkdir(parents=True, exist_ok=True)
        super().__init__(name, cmd, env=env, url=url, cpu=cpu, log_path=log_path, role=role)

    @property
    def cmd(self) -> list[str]:
        return self.argv

    def start(self, env: dict[str, str] | None = None) -> BenchProcess:  # type: ignore[override]
        if env is not None:
            self.env = dict(env)
        super().start()
        return self

    def run_to_end(self, timeout_s: float) -> None:
        """Start it and wait for it to exit; a non-zero exit raises with the end of its log."""
        self.start()
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"{self.name} still running after {timeout_s:.0f} s:\n{self.log_tail()}") from None
        if code != 0:
            raise RuntimeError(f"{self.name} exited with {code}: {' '.join(self.cmd)}\n{self.log_tail()}")

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log().splitlines()[-n:])

    def ps(self) -> psutil.Process | None:
        try:
            return psutil.Process(self.proc.pid) if self.proc else None
        except psutil.NoSuchProcess:
            return None

    def cpu_seconds(self) -> float:
        """User + system CPU of the process and its children so far."""
        p = self.ps()
        if p is None:
            return 0.0
        total = 0.0
        try:
            for q in [p, *p.children(recursive=True)]:
                t = q.cpu_times()
                total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
        return total

    def placement(self) -> dict:
        """Where it may run and how many threads it has."""
        p = self.ps()
        if p is None:
            return {}
        try:
            return {"pid": p.pid, "affinity": p.cpu_affinity(), "threads": p.num_threads()}
        except psutil.NoSuchProcess:
            return {}


def worker_cmd(role: str, port: int, model_dir: Path, kv_backend: str = "tcp", threads: int | None = 1,
               num_blocks: int | None = 1024) -> list[str]:
    """`tandem worker` on loopback; 1024 blocks of 16 tokens (16k tokens) hold any workload here
    (None: the worker sizes its pool, from --kv-memory-fraction on a GPU)."""
    return [*tandem_exe(), "worker", "--role", role, "--model", str(model_dir), "--host", "127.0.0.1",
            "--port", str(port), *(("--threads", str(threads)) if threads else ()),
            *(("--num-blocks", str(num_blocks)) if num_blocks else ()),
            "--kv-backend", "none" if role == "colocated" else kv_backend,
            "--kv-port", "0"]  # any free port: several prefill workers may share the machine


def router_cmd(port: int, workers: list[tuple[str, str]]) -> list[str]:
    cmd = [*tandem_exe(), "router", "--host", "127.0.0.1", "--port", str(port)]
    for role, url in workers:
        # Colocated workers serve /internal/generate like decode workers and are listed as such.
        cmd += ["--prefill" if role == "prefill" else "--decode", url]
    return cmd


def worker_process(name: str, role: str, model_dir: Path, log_path: Path, cpu: int | None, *extra: str,
                   kv_backend: str = "tcp", threads: int | None = 1, num_blocks: int | None = 1024,
                   env: dict[str, str] | None = None) -> BenchProcess:
    """A `tandem worker` BenchProcess on a free port (not started)."""
    port = free_port()
    cmd = [*worker_cmd(role, port, model_dir, kv_backend, threads, num_blocks), *extra]
    return BenchProcess(name, role, f"http://127.0.0.1:{port}", cmd, cpu, log_path, env)


def router_process(name: str, workers: list[BenchProcess], log_path: Path, *extra: str,
                   env: dict[str, str] | None = None) -> BenchProcess:
    """A `tandem router` BenchProcess over the given workers, on a free port (not started)."""
    port = free_port()
    cmd = [*router_cmd(port, [(w.role, w.url) for w in workers]), *extra]
    return BenchProcess(name, "router", f"http://127.0.0.1:{port}", cmd, None, log_path, env)
