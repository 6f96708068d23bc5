"""The arms of a benchmark: sets of real `tandem` processes on loopback, started with the CLIs.

  colocated      two colocated workers (core 0, core 1) behind one router
  colocated-1    one colocated worker on two threads, not pinned (both cores), behind one router
  disagg-nixl    a prefill worker on core 0, a decode worker on core 1, KV over NIXL (UCX)
  disagg-tcp     the same with the TCP handoff
  vllm           the peer: vLLM's CPU build colocated (bench/lib/peers.py), its engine on core 0,
                 its API server floating (the router's place in Tandem's arms)

Every worker but colocated-1's runs one torch thread and is pinned to its core (sched_setaffinity
before exec, so every thread it starts inherits the mask). The router and the load generator are
not pinned: they share both cores with the workers, as they would on a two-core node, and their
CPU is measured and reported.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from bench.lib.processes import BenchProcess, router_process, thread_env, worker_process
from bench.lib.ready import wait_ready

ARMS = ("colocated", "colocated-1", "disagg-nixl", "disagg-tcp", "vllm")


@dataclass
class Arm:
    name: str
    model_dir: Path
    log_dir: Path
    procs: list[BenchProcess] = field(default_factory=list)
    layout: str | None = None  # one of ARMS (default: the name)
    worker_args: tuple[str, ...] = ()  # extra `tandem worker` flags for every worker
    router_args: tuple[str, ...] = ()  # extra `tandem router` flags
    dtype: str = "bfloat16"  # the peer's (Tandem's workers take theirs from worker_args)

    @property
    def router(self) -> BenchProcess:
        """What clients talk to: the router, or the peer's own server."""
        return next(p for p in self.procs if p.role in ("router", "peer"))

    @property
    def url(self) -> str:
        return self.router.url

    @property
    def workers(self) -> list[BenchProcess]:
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
        if layout == "vllm":
            from bench.lib.peers import vllm_process

            self.procs = [vllm_process(self.model_dir, self.log_dir / f"{self.name}-vllm.log", self.dtype)]
            return
        if layout == "colocated":
            roles = [("colocated-0", "colocated", 0), ("colocated-1", "colocated", 1)]
        elif layout == "colocated-1":
            roles = [("colocated-0", "colocated", None)]
        else:
            roles = [("prefill", "prefill", 0), ("decode", "decode", 1)]
        for name, role, cpu in roles:
            self.procs.append(worker_process(name, role, self.model_dir, self.log_dir / f"{self.name}-{name}.log",
                                             cpu, *self.worker_args, kv_backend=self.kv_backend or "tcp",
                                             threads=self.threads))
        self.procs.append(router_process("router", self.workers, self.log_dir / f"{self.name}-router.log",
                                         *self.router_args))

    def start(self) -> None:
        self.plan_processes()
        env = os.environ | thread_env(self.threads)
        for p in self.procs:
            p.start(None if p.role == "peer" else env)  # a peer brings its own environment

    async def wait_ready(self, timeout_s: float = 240.0) -> None:
        await wait_ready(self.procs, timeout_s)

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()

