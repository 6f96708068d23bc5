"""Compiling the decode step: whether to (`compile` auto|on|off), the warm-up at start-up that
compiles every graph the step will need (batch 1 and batch > 1, any table width and pool size),
a failed compile turned into a warning and a metric (or an error with compile: on), and a
decode-only step run through the graph, its new K/V written into the pool after it.

The graph itself is the model's forward (hf/decode_graph.py): a batch of single tokens through
every layer, attending to the pool read-only plus their own new K/V, returning the logits and the
new K/V. Without writes inside, the whole step compiles (torch.compile, inductor) into fused C++
loops around oneDNN matmuls, once at start-up, never inside a request. Steps that carry prompt
chunks run eagerly.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch._inductor.config as inductor_config
import torch.fx.experimental._config as fx_config
from tandem.worker.engine import compile_cache
from tandem.worker.engine.model_runner import StepLogits

if TYPE_CHECKING:
    from tandem.worker.engine.step_inputs import StepInputs

log = logging.getLogger("tandem.worker.engine")

COMPILE_SETTINGS = ("auto", "on", "off")
# After start-up a shape the warm-up did not compile runs eagerly rather than compiling inside a
# request (tests set "fail_on_recompile", here or through $TANDEM_RECOMPILE_STANCE for a worker
# process and its ranks, to prove the warm-up covers every shape).
RECOMPILE_STANCE = os.environ.get("TANDEM_RECOMPILE_STANCE", "eager_on_recompile")
MIN_TABLE_WIDTH = 2  # block tables are padded to this many columns: a width of 1 would compile apart
LONG_SUM = 4096  # inductor's CPU code sums more float32 values than this in chunks (another graph)


def own_code(fn: Callable) -> Callable:
    """`fn` with a code object of its own: dynamo keeps compiled graphs per code object, so no other
    model's graphs (tests load many) sit beside this one's, nor count against its recompile limit."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__)


def run_decode_graph(graph: Callable, st: StepInputs, pool: torch.Tensor) -> StepLogits:
    """A decode-only step through a path's compiled graph (`graph(ids, positions, tables, pool)`:
    logits, argmax, new K/V), the new K/V then written into their slots with one indexed copy."""
    with torch.compiler.set_stance(RECOMPILE_STANCE):
        logits, argmax, new_kv = graph(st.ids, st.positions, st.tables, pool)
    pool[st.slot_blocks, :, :, :, st.slot_offsets] = new_kv
    if len(st.sample_rows) == logits.shape[0]:
        return StepLogits(logits, argmax)
    rows = torch.tensor(st.sample_rows, device=pool.device)
    return StepLogits(logits[rows], argmax[rows])


def compiler_found() -> str | None:
    """The C++ compiler inductor would use, or None (then the engine runs eagerly)."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def should_compile(setting: str, device: torch.device) -> tuple[bool, str]:
    """(compile or not, why) for the `compile` setting: auto compiles on a CPU with a C++ compiler."""
    if setting not in COMPILE_SETTINGS:
        raise ValueError(f"compile must be one of {', '.join(COMPILE_SETTINGS)}, got {setting!r}")
    if setting == "off":
        return False, "compile: off"
    if device.type != "cpu":
        return False, f"no compiled step on {device.type} yet (eager kernels)"
    cxx = compiler_found()
    if cxx is None:
        if setting == "on":
            raise ValueError("compile: on needs a C++ compiler (g++ or clang++; or set CXX)")
        return False, "no C++ compiler found for torch.compile"
    return True, f"torch.compile (inductor, {cxx})"


def compiled_or_eager(setting: str, pool: torch.Tensor, max_context: int, group: Any,
                      build: Callable[[bool], StepGraphs]) -> tuple[StepGraphs, str]:
    """A path's decode graphs (`build(compiled)`), compiled and warmed up now when the setting asks
    for it, and why (for the log). With compile: auto, a compile that fails leaves the engine eager
    with a warning and a metric, not down; a tensor-parallel rank (`group`) cannot fall back alone."""
    enabled, why = should_compile(setting, pool.device)
    graphs = build(enabled)
    try:
        if enabled:
            compile_cache.sweep()  # what a killed compile left would otherwise be taken as built
        graphs.warm_up(pool, max_context)
    except Exception as e:  # noqa: BLE001 - any compiler failure means the same: run eagerly
        if setting == "on":
            raise
        if group is not None and group.size > 1:  # one rank eager, another compiled: their collectives part
            raise RuntimeError(f"torch.compile failed on rank {group.rank} ({type(e).__name__}: {e}); "
                               "a tensor-parallel group cannot leave one rank eager: start it with "
                               "--compile off, or fix the compiler") from e
        compile_cache.RECORD.failures += 1
        compile_cache.RECORD.last_failure = f"{type(e).__name__}: {e}"
        log.warning("torch.compile failed (%s: %s); the decode step runs eagerly, slower (counted in "
                    "tandem_worker_compile_failures_total; compile: on makes it an error)", type(e).__name__, e)
        graphs = build(False)
        why = "eager (torch.compile failed)"
    return graphs, why


def step_compile_options() -> dict:
    """Inductor's options for the decode step: the guards on module attributes go (the module
    never changes: 0.3 ms a call). `cpp_wrapper` was measured and left off: no gain, paired, at
    batch 1 (BENCHMARKS.md, `python -m bench step_options`)."""
    return {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}


class StepGraphs:
    """A path's compiled decode graphs and their warm-up at start-up: `_trace` runs each graph once
    at a batch size and table width, with the dimensions that vary marked dynamic."""

    enabled: bool
    name = "the decode step"

    def __init__(self) -> None:
        self.traced: set[int] = set()  # table widths traced (one per range of context lengths)
        if self.enabled:
            # Each model compiles two graphs (batch 1 and batch > 1) per function; a process that
            # loads several models (tests) would pass dynamo's default limit of 8 per function.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)

    @torch.inference_mode()
    def warm_up(self, pool: torch.Tensor, max_context: int) -> None:
        """Compile every graph the step will need: batch 1, and any batch > 1, each with any
        table width and pool size (dimensions marked dynamic; the rest stay static). Inductor sums
        more than 4096 floats with a different loop, so contexts beyond that get their own graphs."""
        bs = pool.shape[4]
        widths = {MIN_TABLE_WIDTH + 1}  # != batch: sizes equal while tracing risk a specialisation
        if -(-max_context // bs) * bs + 1 > LONG_SUM:
            widths.add(LONG_SUM // bs + 1)
        widths -= self.traced
        if not self.enabled or not widths:
            return
        t0 = time.monotonic()
        # No duck sizing: two dynamic sizes that happen to be equal while tracing must not become
        # one symbol. At batch 1, a low realize threshold keeps a norm or an activation from being
        # recomputed inside every row of the matrix-vector product that reads it; at batch > 1 the
        # default keeps the attention's block gather fused into its loops.
        with fx_config.patch(use_duck_shape=False):
            for width in sorted(widths):
                with inductor_config.patch(realize_opcount_threshold=4):
                    self._trace(pool, 1, width)
                self._trace(pool, 2, width)
        self.traced |= widths
        log.info("compiled %s in %.1fs", self.name, time.monotonic() - t0)

    def _trace(self, pool: torch.Tensor, batch: int, width: int) -> None:
        raise NotImplementedError


def step_example(pool: torch.Tensor, batch: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step's ids, positions and block tables to trace with, their varying sizes marked
    dynamic (the table width; at batch > 1 the batch; the pool's blocks)."""
    dev = pool.device
    ids = torch.zeros(batch, dtype=torch.long, device=dev)
    pos = torch.ones(batch, dtype=torch.long, device=dev)
    tables = torch.zeros(batch, width, dtype=torch.long, device=dev)
    dynamic = [(tables, 1), (pool, 0)] + ([(ids, 0), (pos, 0), (tables, 0)] if batch > 1 else [])
    for t, dim in dynamic:
        torch._dynamo.mark_dynamic(t, dim)
    return ids, pos, tables
