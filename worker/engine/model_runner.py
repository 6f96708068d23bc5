"""The one interface between the engine and a model: a runner takes a step's `BatchItem`s and
returns the sampled rows' logits (`StepLogits`). Its implementation is the transformers path
(hf/runner.py: the model's own classes over the paged pool, the decode step compiled on a CPU).
Under tensor parallelism every rank runs one over its share, and rank 0's engine calls the
LeaderRunner that sends each step to the others (parallel/executor.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
from tandem.contracts.kv_layout import KVLayout


@dataclass
class BatchItem:
    """One sequence's part of a step: its tokens to run, from which position, over which blocks."""

    token_ids: list[int]
    start: int  # position of token_ids[0] in the sequence
    block_table: list[int]
    sample: bool  # return logits for the last token


class StepLogits(NamedTuple):
    logits: torch.Tensor  # [sampled rows, vocab], float32
    argmax: torch.Tensor | None = None  # their argmax, when the step computed it


class ModelRunner(Protocol):
    ranks: tuple  # tensor parallelism: the group's other ranks (KVRank endpoints) on rank 0; else ()

    def forward(self, items: list[BatchItem]) -> StepLogits: ...

    def problem(self) -> str | None:
        """Why the runner cannot run a step any more (a failed tensor-parallel group), or None."""


def build_runner(loaded: Any, pool: torch.Tensor, layout: KVLayout, compile_setting: str, max_context: int
                 ) -> tuple[ModelRunner, str]:
    """The engine's runner for a loaded model over `pool`, and how its steps run (for the start-up
    log): on rank 0 of a tensor-parallel group, the one that drives the group."""
    runner, why = rank_runner(loaded, pool, layout, compile_setting, max_context)
    group = getattr(loaded, "group", None)
    if group is None or group.size == 1:
        return runner, why
    from tandem.worker.engine.parallel.executor import LeaderRunner, StepLimits

    text = loaded.config.get_text_config() if hasattr(loaded.config, "get_text_config") else loaded.config
    limits = StepLimits(vocab=text.vocab_size, positions=max_context, blocks=layout.num_blocks,
                        block_size=layout.block_size)
    return LeaderRunner(runner, group, limits), why


def rank_runner(loaded: Any, pool: torch.Tensor, layout: KVLayout, compile_setting: str = "off",
                max_context: int = 0) -> tuple[ModelRunner, str]:
    """The transformers path's forward pass over this rank's share, loaded narrowed to it
    (hf/rank_loading.py); every rank of a group builds one at the same time: its start-up check runs
    the group's collectives."""
    from tandem.worker.engine.hf.runner import TransformersForward
    group = getattr(loaded, "group", None)
    runner = TransformersForward(loaded.model, pool, layout, compile_setting, max_context, group)
    why = f"transformers' model classes, paged attention, {runner.how}"
    if group is not None and group.size > 1:
        why += f", rank {group.rank} of {group.size} (heads and experts split)"
    return runner, why
