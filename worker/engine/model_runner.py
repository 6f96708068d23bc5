"""The one interface between the engine and a model: a runner takes a step's `BatchItem`s and
returns the sampled rows' logits (`StepLogits`). Two implementations, chosen per model by the
loader: the native forward pass (paged_forward.py, hand-written, compiled on a CPU; under tensor
parallelism rank 0's runner that drives the group) and the transformers path (hf/runner.py, the model's own classes over the same paged pool)."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from tandem.contracts.kv_layout import KVLayout
from tandem.contracts.model_support import ModelBackend
from tandem.worker.engine.paged_forward import BatchItem, StepLogits


class ModelRunner(Protocol):
    def forward(self, items: list[BatchItem]) -> StepLogits: ...

    def problem(self) -> str | None:
        """Why the runner cannot run a step any more (a failed tensor-parallel group), or None."""


def build_runner(loaded: Any, pool: torch.Tensor, layout: KVLayout, compile_setting: str, max_context: int
                 ) -> tuple[ModelRunner, str]:
    """The runner for a loaded model over `pool`, and how its steps run (for the start-up log)."""
    if loaded.backend is ModelBackend.TRANSFORMERS:
        from tandem.worker.engine.hf.runner import TransformersForward

        return TransformersForward(loaded.model, pool, layout), "transformers' model classes, paged attention"
    from tandem.worker.engine.decode_step import prepare_kernels
    from tandem.worker.engine.paged_forward import model_runner
    from tandem.worker.engine.weights import model_weights

    weights = model_weights(loaded)
    kernels, why = prepare_kernels(weights, compile_setting, pool, max_context)
    return model_runner(weights, pool, layout, kernels), why
