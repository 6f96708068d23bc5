"""Two fixes for vLLM's NIXL disaggregation on a CPU, applied inside every vLLM process as a vLLM
general plugin (entry-point group `vllm.general_plugins`, which vLLM loads in its API server,
engine and worker processes before any connector is built). `tandem.worker.vllm.launch` puts this
module, as `tandem_vllm_cpu_fixes`, on the PYTHONPATH of the `vllm serve` it starts; each fix is
on only when its environment variable says so.

- NIXL's progress thread polls every TANDEM_NIXL_PROGRESS_DELAY_US microseconds, or is off
  (TANDEM_NIXL_PROGRESS_THREAD=0). vLLM builds its agent with `nixl_agent_config(num_threads=...,
  capture_telemetry=True)`, whose progress thread is on with NIXL's python API fixing its delay at
  zero: a thread that busy-polls UCX (about half a core, idle or not). Neither vLLM nor NIXL has a
  setting for either, so the agent's config class is given the delay (or the thread's default
  becomes off). Off, only vLLM's engine loop drives the transfers (it polls them every step): on
  UCX over TCP a prefill server then serves its KV to decode servers only between its steps, which
  under load made the first gap after a handoff seconds long; the launcher's default is on, 1 ms.
- The compute thread stays where Tandem bound it (TANDEM_VLLM_KEEP_AFFINITY=1). On a CPU, vLLM's
  NIXL worker moves its calling thread, the one that computes the model, onto the last core of
  each NUMA node (`os.sched_setaffinity(0, ...)` over `discover_numa_topology()`), meant to keep KV
  loads off the compute cores; here it puts a prefill pinned to core 0 beside decode on core 1.
  With no cores reported, the worker leaves the thread alone and VLLM_CPU_OMP_THREADS_BIND rules.

Standalone on purpose: it runs in vLLM's interpreter, where Tandem is not installed.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

NIXL_PROGRESS_THREAD_ENV = "TANDEM_NIXL_PROGRESS_THREAD"
NIXL_PROGRESS_DELAY_ENV = "TANDEM_NIXL_PROGRESS_DELAY_US"
KEEP_AFFINITY_ENV = "TANDEM_VLLM_KEEP_AFFINITY"
_PATCHED = "_tandem_patched"


def register() -> None:
    """vLLM's plugin hook: it may run more than once per process, and each fix applies once."""
    if os.environ.get(NIXL_PROGRESS_THREAD_ENV) == "0":
        _on_nixl_load("nixl_agent_config", _default_no_progress)
    elif os.environ.get(NIXL_PROGRESS_DELAY_ENV):
        delay_us = int(os.environ[NIXL_PROGRESS_DELAY_ENV])
        _on_nixl_load("NixlWrapper", lambda agent_cls: _delay_configs(sys.modules[agent_cls.__module__], delay_us))
    if os.environ.get(KEEP_AFFINITY_ENV) == "1":
        _keep_affinity()


def _on_nixl_load(name: str, patch: Callable[[Any], None]) -> None:
    """patch(value) on NIXL's `name` as vLLM loads it (lazily, so NIXL is never imported here before
    vLLM has set UCX's environment), or at once if vLLM already has."""
    import vllm.distributed.nixl_utils as nixl_utils

    loaded = nixl_utils.__dict__.get(name)
    if loaded is not None:
        patch(loaded)
    load = nixl_utils._load_nixl_attr
    if getattr(load, _PATCHED, False):
        return

    def load_then_patch(attr: str) -> Any:
        value = load(attr)
        if attr == name and value is not None:
            patch(value)
        return value

    setattr(load_then_patch, _PATCHED, True)
    nixl_utils._load_nixl_attr = load_then_patch


def _delay_configs(api: Any, delay_us: int) -> None:
    """The progress thread sleeps `delay_us` between its polls: NIXL's python API (`api`) writes
    pthrDelay = 0 (a busy poll) into the config it builds its agent from, so the config class it
    reads from its bindings keeps this delay instead."""
    bind = api.nixlBind
    if getattr(bind, _PATCHED, False):
        return
    base = bind.nixlAgentConfig

    class DelayedConfig(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:  # noqa: N802 - NIXL's name
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, _value: int) -> None:  # noqa: N802
            base.pthrDelay.__set__(self, delay_us)

    class Bind:  # nixlBind as the agent's module sees it, but for its config class
        def __getattr__(self, name: str) -> Any:
            return getattr(bind, name)

    patched = Bind()
    patched.nixlAgentConfig = DelayedConfig  # type: ignore[attr-defined]
    setattr(patched, _PATCHED, True)
    api.nixlBind = patched


def _default_no_progress(config_cls: type) -> None:
    init = config_cls.__init__
    if getattr(init, _PATCHED, False):
        return

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if not args:  # enable_prog_thread is the first parameter: a positional value is the caller's
            kwargs.setdefault("enable_prog_thread", False)
        init(self, *args, **kwargs)

    setattr(__init__, _PATCHED, True)
    config_cls.__init__ = __init__


def _keep_affinity() -> None:
    from vllm.platforms.cpu import CpuPlatform

    if getattr(CpuPlatform.discover_numa_topology, _PATCHED, False):
        return

    def no_cores_reserved_for_kv(cls: type) -> list[list[int]]:
        return []

    setattr(no_cores_reserved_for_kv, _PATCHED, True)
    CpuPlatform.discover_numa_topology = classmethod(no_cores_reserved_for_kv)
