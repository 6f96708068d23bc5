"""The model runner built from transformers' own model classes: any verified decoder-only causal LM
(contracts/model_support.py) runs on Tandem's paged KV pool, `BatchItem`s in and `StepLogits` out
(model_runner.py), so continuous batching, chunked prefill, the prefix cache, KV handoff and
migration know nothing of the model.

One step is one call of the model's forward on the flat batch ([1, tokens], each token with its
own position); every attention layer goes through paged_attention.py, and the model's head keeps
only the sampled rows (`logits_to_keep`), so final soft-capping or logit scaling stay the model's.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from tandem.contracts.kv_layout import KVLayout
from tandem.worker.engine.decode_step import compiled_or_eager, run_decode_graph
from tandem.worker.engine.errors import ModelLoadError
from tandem.worker.engine.hf.decode_graph import (
    STEP_KWARG,
    CompiledDecode,
    decode_graphs,
    decoder_layers,
)
from tandem.worker.engine.hf.packed_linears import pack_linears
from tandem.worker.engine.hf.paged_attention import PagedStep, layer_windows
from tandem.worker.engine.model_runner import BatchItem, StepLogits
from tandem.worker.engine.step_inputs import StepInputs, step_inputs

log = logging.getLogger("tandem.worker.engine")


class TransformersForward:
    # Under tensor parallelism rank 0's LeaderRunner lists the other ranks; a rank's own runner none.
    ranks: tuple = ()

    def __init__(self, model: Any, pool: torch.Tensor, layout: KVLayout, compile_setting: str = "off",
                 max_context: int = 0, group: Any = None):
        self.model = model
        self.pool = pool
        self.layout = layout
        self.block_size = layout.block_size
        self.device = pool.device
        try:
            self.windows = layer_windows(model.config)
        except ValueError as e:
            raise ModelLoadError(f"{type(model).__name__} cannot run on the transformers path: {e}") from e
        keeps = getattr(model, "_supports_logits_to_keep", None)
        self.keeps_logits = bool(keeps and keeps())
        self.sinks = self._check_every_layer_attends()
        self.packed = pack_linears(model)
        self.kernels, self.how = self._decode_graphs(compile_setting, max_context, group)

    def _decode_graphs(self, setting: str, max_context: int, group: Any) -> tuple[CompiledDecode, str]:
        """The compiled decode step where this model can have one (decode_graph.py), and how steps run."""
        cannot = "attention sinks" if self.sinks else None
        if cannot is None and decoder_layers(self.model) is None:
            cannot = "no list of decoder layers to compile one by one"
        if cannot is not None and setting == "on":
            raise ModelLoadError(f"compile: on, but {type(self.model).__name__} has no compiled decode step: {cannot}")
        if cannot is not None or setting == "off":
            return decode_graphs(self.model, self.windows, False, self.block_size), f"eager decode step ({cannot or 'compile: off'})"
        graphs, why = compiled_or_eager(setting, self.pool, max_context, group,
                                        lambda on: decode_graphs(self.model, self.windows, on, self.block_size))
        return graphs, why

    def problem(self) -> str | None:
        """Nothing breaks this runner for good between steps (one process, one rank)."""
        return None

    @torch.inference_mode()
    def forward(self, items: list[BatchItem]) -> StepLogits:
        """Logits (float32) for the last token of every item with sample=True, in order."""
        st = step_inputs(items, self.block_size, self.device)
        if st.decode_only and self.kernels.decode_step is not None:
            return run_decode_graph(self.kernels.decode_step, st, self.pool)
        logits, _ = self._run(st)
        return StepLogits(logits)

    def _run(self, st: StepInputs) -> tuple[torch.Tensor, PagedStep]:
        step = PagedStep.build(self.pool, st, self.windows)
        rows = torch.tensor(st.sample_rows or [0], dtype=torch.long, device=self.device)
        kwargs: dict[str, Any] = {STEP_KWARG: step}
        if self.keeps_logits:
            kwargs["logits_to_keep"] = rows
        out = self.model(input_ids=st.ids[None], position_ids=st.positions[None], use_cache=False, **kwargs)
        logits = out.logits[0] if self.keeps_logits else out.logits[0, rows]
        if not st.sample_rows:
            return logits.new_empty((0, logits.shape[-1]), dtype=torch.float32), step
        return logits.float(), step

    @torch.inference_mode()
    def _check_every_layer_attends(self) -> bool:
        """One token through the model at start-up (into block 0, which nothing holds yet): every
        layer must have attended through the pool exactly once, in order, or this model computes
        attention some other way and its output would be wrong; refuse it here instead. True when
        a layer has attention sinks."""
        try:
            _, step = self._run(step_inputs([BatchItem([0], 0, [0], True)], self.block_size, self.device))
        except RuntimeError as e:
            raise ModelLoadError(f"{type(self.model).__name__} cannot run on the transformers path: {e}") from e
        want = list(range(self.layout.num_layers))
        if step.layers_seen != want:
            raise ModelLoadError(
                f"{type(self.model).__name__} does not route every layer's attention through the paged KV "
                f"cache (layers seen: {step.layers_seen}, expected {want}); it cannot run on the "
                "transformers path")
        self.pool.zero_()
        return step.sinks
