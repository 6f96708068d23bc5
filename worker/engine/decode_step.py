"""The decode step: a batch of single tokens through every layer, attending to the pool read-only
plus their own new K/V, returning the logits and the new K/V to write afterwards.

Without writes inside, the whole step compiles (torch.compile, inductor) into fused C++ loops
around oneDNN matmuls, with the batch size and the block-table width dynamic: compiled once at
start-up, never inside a request. Its decoder layer is a nested compile region, compiled once and
called by every layer, so a 30-layer model compiles about what a 1-layer one does. Steps that
carry prompt chunks run eagerly (paged_forward.py).
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
from tandem.worker.engine import compile_cache, layers
from tandem.worker.engine.attention import paged_decode_attention, sdpa_decode_attention
from tandem.worker.engine.model_runner import StepLogits
from tandem.worker.engine.weights import ModelWeights
from torch import nn

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


def decode_layer(w: ModelWeights, layer: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 pool_layer: torch.Tensor, tables: torch.Tensor, positions: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer of the decode step: h [B, hidden] on, and the layer's new K/V [B, kv_heads, 2, d]."""
    q, k, v = layers.qkv(w, layer, h, cos, sin)
    attn = paged_decode_attention(q, pool_layer, tables, positions, w.shape.scaling, k, v)
    return layers.finish(w, layer, h, attn), torch.stack([k, v], dim=2)


def decode_head(w: ModelWeights, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The final norm and output head: logits [B, vocab] (float32) and their argmax [B]."""
    logits = layers.logits(w, h)
    return logits, logits.argmax(-1)


class DecodeStep(nn.Module):
    """The decode step through `layer` (decode_layer, once per layer) and `head` (decode_head)."""

    def __init__(self, weights: ModelWeights, layer: Callable = decode_layer, head: Callable = decode_head):
        super().__init__()
        self.w = weights
        self.layer, self.head = layer, head

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor, pool: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ids, positions [B]; tables [B, width] covering positions < positions[b].
        Returns logits [B, vocab] (float32), their argmax [B] (greedy rows need nothing else)
        and the new K/V [B, kv_heads, layers, 2, d] (the pool's order)."""
        w = self.w
        h = w.embed(ids)
        cos, sin = w.cos[positions], w.sin[positions]
        new_kv = []
        for li, layer in enumerate(w.layers):
            h, kv = self.layer(w, layer, h, cos, sin, pool[:, :, li], tables, positions)
            new_kv.append(kv)
        logits, argmax = self.head(w, h)
        return logits, argmax, torch.stack(new_kv, dim=2)


def own_code(fn: Callable) -> Callable:
    """`fn` with a code object of its own: dynamo keeps compiled graphs per code object, so no other
    model's graphs (tests load many) sit beside this one's, nor count against its recompile limit."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__)


def step_to_compile(weights: ModelWeights) -> DecodeStep:
    """The decode step as torch.compile takes it: its layer a nested compile region, which dynamo
    traces once and inductor compiles once, each layer calling it with its own weights (the weights
    are the region's inputs), so the compile costs one layer, not the model's depth; code objects of
    its own (own_code), so no other model's graphs sit beside these."""
    step = DecodeStep(weights, torch.compiler.nested_compile_region(own_code(decode_layer)), decode_head)
    step.forward = types.MethodType(own_code(DecodeStep.forward), step)
    return step


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


def prepare_kernels(weights: ModelWeights, setting: str, pool: torch.Tensor, max_context: int
                    ) -> tuple[CompiledKernels, str]:
    """The native path's kernels for an engine, compiled now when the setting asks for it."""
    return compiled_or_eager(setting, pool, max_context, weights.group,
                             lambda enabled: kernels_for(weights, enabled, pool.shape[4]))


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


def kernels_for(weights: ModelWeights, enabled: bool, block_size: int) -> CompiledKernels:
    """One set of kernels per model weights, setting and block size (the graphs are compiled for
    one): engines over the same loaded model (tests build many) share them, compiled once."""
    cache = weights.__dict__.setdefault("_kernels", {})
    if (enabled, block_size) not in cache:
        cache[enabled, block_size] = CompiledKernels(weights, enabled)
    return cache[enabled, block_size]


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


class CompiledKernels(StepGraphs):
    """The native path's decode step and decode attention, compiled or eager."""

    def __init__(self, weights: ModelWeights, enabled: bool):
        self.enabled = enabled
        super().__init__()
        self.shape = weights.shape
        self.decode_step: Callable | None = None
        self.decode_attention: Callable = sdpa_decode_attention
        if enabled:
            # The guards on module attributes (0.3 ms a call) can go: these modules never change,
            # and their weights are the graphs' inputs (read at every call: each layer its own).
            self.decode_step = torch.compile(step_to_compile(weights), dynamic=False, fullgraph=True,
                                             options=step_compile_options())
            self.decode_attention = torch.compile(paged_decode_attention, dynamic=False, fullgraph=True)

    def _trace(self, pool: torch.Tensor, batch: int, width: int) -> None:
        ids, pos, tables = step_example(pool, batch, width)
        q = torch.zeros(batch, self.shape.num_heads, self.shape.head_dim, dtype=pool.dtype, device=pool.device)
        pool_layer, lens = pool[:, :, 0], pos + 1
        dynamic = [(pool_layer, 0)] + ([(q, 0), (lens, 0)] if batch > 1 else [])
        for t, dim in dynamic:
            torch._dynamo.mark_dynamic(t, dim)
        self.decode_step(ids, pos, tables, pool)
        self.decode_attention(q, pool_layer, tables, lens, self.shape.scaling)
