"""The forward pass over the paged KV pool: a flat batch of tokens from many sequences (prefill
chunks and decode tokens mixed) through the model's fused weights (weights.py).

A step of decode tokens only runs the compiled decode graph (decode_step.py), which reads the
pool and returns the new K/V; they are written into their slots with one indexed copy after it.
A step carrying prompt chunks runs eagerly, layer by layer: its K/V are written first, decode
tokens then attend by block table, and each chunk with SDPA over its context.
"""

from __future__ import annotations

import torch
from tandem.contracts.kv_layout import KVLayout
from tandem.worker.engine import decode_step, layers
from tandem.worker.engine.attention import chunk_attention, gather_context
from tandem.worker.engine.decode_step import CompiledKernels, run_decode_graph
from tandem.worker.engine.model_runner import BatchItem, StepLogits
from tandem.worker.engine.step_inputs import StepInputs, step_inputs
from tandem.worker.engine.weights import ModelWeights


class PagedForward:
    # A tensor-parallel runner (parallel/executor.py) lists its group's other ranks (KVRank endpoints).
    ranks: tuple = ()

    def __init__(self, weights: ModelWeights, pool: torch.Tensor, layout: KVLayout, kernels: CompiledKernels):
        self.w = weights
        self.pool = pool
        self.layout = layout
        self.block_size = layout.block_size
        self.kernels = kernels
        self.device = pool.device

    def problem(self) -> str | None:
        """Why this runner cannot run a step any more (a tensor-parallel group that failed:
        parallel/executor.py), or None; the engine's health reports it."""
        return None

    @torch.inference_mode()
    def forward(self, items: list[BatchItem]) -> StepLogits:
        """Logits (float32) for the last token of every item with sample=True, in order."""
        st = step_inputs(items, self.block_size, self.device)
        if st.decode_only and self.kernels.decode_step is not None:
            return run_decode_graph(self.kernels.decode_step, st, self.pool)
        return StepLogits(self._eager(st))

    def _eager(self, st: StepInputs) -> torch.Tensor:
        w, pool = self.w, self.pool
        h = w.embed(st.ids)
        cos, sin = w.cos[st.positions], w.sin[st.positions]
        dec = torch.tensor(st.decode_rows, dtype=torch.long, device=self.device) if st.decode_rows else None
        lens = st.positions[dec] + 1 if dec is not None else None
        for li, layer in enumerate(w.layers):
            q, k, v = layers.qkv(w, layer, h, cos, sin)
            pool_layer = pool[:, :, li]
            pool_layer[st.slot_blocks, :, 0, st.slot_offsets] = k
            pool_layer[st.slot_blocks, :, 1, st.slot_offsets] = v
            out = torch.empty_like(q)
            if dec is not None:
                with torch.compiler.set_stance(decode_step.RECOMPILE_STANCE):
                    out[dec] = self.kernels.decode_attention(q[dec], pool_layer, st.tables, lens, w.shape.scaling)
            for c in st.chunks:
                rows = slice(c.offset, c.offset + c.num_tokens)
                if c.table is None:  # the chunk is the whole sequence so far: its own K/V suffice
                    ks, vs = k[rows], v[rows]
                else:
                    ks, vs = gather_context(pool_layer, c.table, c.start + c.num_tokens)
                out[rows] = chunk_attention(q[rows], ks, vs, c.start, w.shape.scaling)
            h = layers.finish(w, layer, h, out)
        if not st.sample_rows:
            return torch.empty(0, w.shape.vocab, device=self.device)
        return layers.logits(w, h[torch.tensor(st.sample_rows, device=self.device)])
