"""The arms of a benchmark: sets of real `tandem` processes on loopback, started with the CLIs.

  colocated      two colocated workers (core 0, core 1) behind one router
  colocated-1    one colocated worker on two threads, not pinned (both cores), behind one router
  disagg-nixl    a prefill worker on core 0, a decode worker on core 1, KV over NIXL (UCX)
  disagg-tcp     the same with the TCP handoff

Every worker but colocated-1's runs one torch thread and is pinned to its core (sched_setaffinity
before exec, so every thread it starts inherits the mask). The router and the load generator are
not pinned: they share both cores with the workers, as they would on a two-core node, and their
CPU is measured and reported.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil
from tandem.worker.local.processes import ManagedProcess, free_port

ARMS = ("colocated", "colocated-1", "disagg-nixl", "disagg-tcp")


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
    return [sys.executable, "-m", "tandem.cli"]


class Proc(ManagedProcess):
    """A benchmark's child process: tandem.worker.local.processes' ManagedProcess (own process
    group, dies with us, optionally pinned to one core) plus the CPU and placement it reports."""

    def __init__(self, name: str, role: str, url: str, cmd: list[str], cpu: int | None, log_path: Path):
        # name: "router", "prefill", "decode", "colocated-0", ...; role: router|prefill|decode|colocated
        log_path.parent.mkdir(parents=True, exist_ok=True)
        super().__init__(name, cmd, url=url, cpu=cpu, log_path=log_path, role=role)

    @property
    def cmd(self) -> list[str]:
        return self.argv

    @property
    def popen(self) -> subprocess.Popen | None:
        return self.proc

    def start(self, env: dict[str, str] | None = None) -> Proc:  # type: ignore[override]
        if env is not None:
            self.env = dict(env)
        super().start()
        return self

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
        """Where it may run and how many threads it has: pinning is checked, not assumed."""
        p = self.ps()
        if p is None:
            return {}
        try:
            return {"pid": p.pid, "affinity": p.cpu_affinity(), "threads": p.num_threads()}
        except psutil.NoSuchProcess:
            return {}


@dataclass
class Arm:
    name: str
    model_dir: Path
    log_dir: Path
    procs: list[Proc] = field(default_factory=list)
    layout: str | None = None  # one of ARMS (default: the name)
    worker_args: tuple[str, ...] = ()  # extra `tandem worker` flags for every worker
    router_args: tuple[str, ...] = ()  # extra `tandem router` flags

    @property
    def router(self) -> Proc:
        return next(p for p in self.procs if p.role == "router")

    @property
    def url(self) -> str:
        return self.router.url

    @property
    def workers(self) -> list[Proc]:
        return [p for p in self.procs if p.role != "router"]

    @property
    def threads(self) -> int:
        """Torch threads per worker: the one worker of colocated-1 gets both cores."""
        return 2 if (self.layout or self.name) == "colocated-1" else 1

    @property
    def kv_backend(self) -> str | None:
        return {"disagg-nixl": "nixl", "disagg-tcp": "tcp"}.get(self.layout or self.name)

    def plan_processes(self) -> None:
        layout = self.layout or self.name
        if layout not in ARMS:
            raise ValueError(f"unknown arm layout {layout!r}; choose from {ARMS}")
        self.procs = []
        if layout == "colocated":
            roles = [("colocated-0", "colocated", 0), ("colocated-1", "colocated", 1)]
        elif layout == "colocated-1":
            roles = [("colocated-0", "colocated", None)]
        else:
            roles = [("prefill", "prefill", 0), ("decode", "decode", 1)]
        for name, role, cpu in roles:
            port = free_port()
            cmd = worker_cmd(role, port, self.model_dir, self.kv_backend or "tcp", self.threads)
            self.procs.append(Proc(name, role, f"http://127.0.0.1:{port}", [*cmd, *self.worker_args],
                                   cpu, self.log_dir / f"{self.name}-{name}.log"))
        port = free_port()
        self.procs.append(Proc(
            "router", "router", f"http://127.0.0.1:{port}",
            [*router_cmd(port, [(w.role, w.url) for w in self.workers]), *self.router_args], None,
            self.log_dir / f"{self.name}-router.log",
        ))

    def start(self) -> None:
        self.plan_processes()
        env = dict(os.environ)
        # `threads` compute threads per worker; every library that might start a pool is told so.
        n = str(self.threads)
        env.update(OMP_NUM_THREADS=n, MKL_NUM_THREADS=n, OPENBLAS_NUM_THREADS=n,
                   TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        for p in self.procs:
            p.start(env)

    async def wait_ready(self, timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as s:
            for p in self.procs:
                path = "/ready" if p.role != "router" else "/v1/models"
                while True:
                    if not p.alive():
                        raise RuntimeError(
                            f"{self.name}: {p.name} exited with {p.popen.returncode if p.popen else '?'}"
                            f"; command: {' '.join(p.cmd)}\n--- log tail ---\n{p.log_tail()}")
                    try:
                        async with s.get(p.url + path, timeout=aiohttp.ClientTimeout(total=2)) as r:
                            if r.status == 200:
                                break
                    except (aiohttp.ClientError, TimeoutError):
                        pass
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{self.name}: {p.name} not ready after {timeout_s:.0f}s"
                                           f"\n--- log tail ---\n{p.log_tail()}")
                    await asyncio.sleep(0.5)
            # The router learns its workers by polling them: wait until it routes a request.
            await _wait_router_serves(s, self.url, deadline)

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


async def _wait_router_serves(s: aiohttp.ClientSession, url: str, deadline: float) -> None:
    last = ""
    while time.monotonic() < deadline:
        try:
            async with s.get(url + "/v1/models", timeout=aiohttp.ClientTimeout(total=2)) as r:
                model = (await r.json())["data"][0]["id"]
            body = {"model": model, "prompt": "hello", "max_tokens": 2, "temperature": 0}
            async with s.post(url + "/v1/completions", json=body,
                              timeout=aiohttp.ClientTimeout(total=60)) as r:
                if r.status == 200:
                    return
                last = f"HTTP {r.status}: {(await r.text())[:200]}"
        except (aiohttp.ClientError, TimeoutError, KeyError, IndexError, ValueError) as e:
            last = f"{type(e).__name__}: {e}"
        await asyncio.sleep(0.5)
    raise TimeoutError(f"router {url} does not serve a request: {last}")


def worker_cmd(role: str, port: int, model_dir: Path, kv_backend: str, threads: int = 1) -> list[str]:
    return [*tandem_exe(), "worker", "--role", role, "--model", str(model_dir),
            "--host", "127.0.0.1", "--port", str(port), "--threads", str(threads),
            # 1024 blocks of 16 tokens: 16k tokens (256 MiB) of KV, more than any workload holds.
            "--num-blocks", "1024", "--kv-backend", "none" if role == "colocated" else kv_backend,
            "--kv-port", "0"]  # any free port: several prefill workers may share the machine


def router_cmd(port: int, workers: list[tuple[str, str]]) -> list[str]:
    cmd = [*tandem_exe(), "router", "--host", "127.0.0.1", "--port", str(port)]
    for role, url in workers:
        # Colocated workers serve /internal/generate like decode workers and are listed as such.
        cmd += ["--prefill" if role == "prefill" else "--decode", url]
    return cmd
