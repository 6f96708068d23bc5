"""Two fixes for vLLM's NIXL disaggregation on a CPU, applied inside every vLLM process as a vLLM
general plugin (entry-point group `vllm.general_plugins`, which vLLM loads in its API server,
engine and worker processes before any connector is built). `tandem.worker.vllm.launch` puts this
module, as `tandem_vllm_cpu_fixes`, on the PYTHONPATH of the `vllm serve` it starts; each fix is
on only when its environment variable says so.

- No NIXL progress thread (TANDEM_NIXL_PROGRESS_THREAD=0). vLLM builds its agent with
  `nixl_agent_config(num_threads=..., capture_telemetry=True)`, whose `enable_prog_thread`
  defaults to True with a zero delay: a thread that busy-polls UCX (about half a core, idle or
  not). Neither vLLM nor NIXL has a setting for it, so the default becomes False; vLLM's engine
  loop already drives the transfers (it polls their state and notifications every step).
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
from typing import Any

NIXL_PROGRESS_THREAD_ENV = "TANDEM_NIXL_PROGRESS_THREAD"
KEEP_AFFINITY_ENV = "TANDEM_VLLM_KEEP_AFFINITY"
_PATCHED = "_tandem_patched"


def register() -> None:
    """vLLM's plugin hook: it may run more than once per process, and each fix applies once."""
    if os.environ.get(NIXL_PROGRESS_THREAD_ENV) == "0":
        _no_progress_thread()
    if os.environ.get(KEEP_AFFINITY_ENV) == "1":
        _keep_affinity()


def _no_progress_thread() -> None:
    """Default `enable_prog_thread` to False on NIXL's agent config class when vLLM loads it
    (lazily, so NIXL is never imported here before vLLM has set UCX's environment)."""
    import vllm.distributed.nixl_utils as nixl_utils

    loaded = nixl_utils.__dict__.get("nixl_agent_config")
    if loaded is not None:
        _default_no_progress(loaded)
    load = nixl_utils._load_nixl_attr
    if getattr(load, _PATCHED, False):
        return

    def load_then_patch(name: str) -> Any:
        value = load(name)
        if name == "nixl_agent_config" and value is not None:
            _default_no_progress(value)
        return value

    setattr(load_then_patch, _PATCHED, True)
    nixl_utils._load_nixl_attr = load_then_patch


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
