"""How many prompt tokens a step may prefill beside decoding streams, sized from measured step times.

A step that prefills a prompt chunk next to running streams delays each of their tokens by the
chunk's cost. With a stall factor F, the chunk is sized so that such a step lasts at most F
ordinary decode steps: chunk = (F - 1) x ordinary step / seconds a prompt token adds to a step,
both measured from the engine's own steps (exponentially weighted). A step's fixed cost that a
chunk brings with it (its eager layers, its index tensors) is counted per token of the chunk that
paid it, so the estimate is conservative for small chunks and the size settles where a chunk's
whole cost fits (the fixed point of size = budget / (fixed / size + per token)). With no stream
decoding the step may take the configured maximum: nobody waits on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

WEIGHT = 0.25  # of a new observation in the moving averages: a few steps follow a change of load


@dataclass
class ChunkSizer:
    max_tokens: int  # prefill_chunk_tokens: the most a step ever prefills
    stall_factor: float  # a step with a chunk lasts at most this many ordinary decode steps (> 1)
    min_tokens: int = 16  # a block: a prompt always advances, whatever the measurements say
    ordinary_s: float | None = None  # a decode-only step, moving average
    token_s: float | None = None  # what one prompt token adds to a step beside streams, moving average

    def __post_init__(self) -> None:
        if self.stall_factor <= 1:
            raise ValueError(f"the prefill stall factor must be above 1 (a step with a chunk lasts longer than "
                             f"one without), got {self.stall_factor}")
        self.min_tokens = max(1, min(self.min_tokens, self.max_tokens))

    def observe(self, seconds: float, decode_tokens: int, prompt_tokens: int) -> None:
        """One step that ran: its wall time, its decode tokens and prompt tokens."""
        if prompt_tokens == 0:
            if decode_tokens:
                self.ordinary_s = _mix(self.ordinary_s, seconds)
            return
        if decode_tokens and self.ordinary_s is not None:
            self.token_s = _mix(self.token_s, max(0.0, seconds - self.ordinary_s) / prompt_tokens)
        elif not decode_tokens:
            self.token_s = _mix(self.token_s, seconds / prompt_tokens)  # alone: every cost is the prompt's

    def budget(self, decoding: int) -> int:
        """Prompt tokens the next step may prefill with `decoding` sequences decoding in it."""
        if decoding == 0:
            return self.max_tokens
        if self.ordinary_s is None or self.token_s is None:
            return self.min_tokens  # nothing measured yet: a small chunk, then measured
        if self.token_s <= 0:
            return self.max_tokens
        room = (self.stall_factor - 1.0) * self.ordinary_s / self.token_s
        return max(self.min_tokens, min(self.max_tokens, int(room)))


def sizer_for(scheduler: Any, stall_factor: float | None, block_size: int) -> ChunkSizer | None:
    """The scheduler's chunk sizer for this setting (None: fixed chunks), wired in."""
    if stall_factor is None:
        return None
    sizer = ChunkSizer(scheduler.prefill_chunk_tokens, stall_factor, block_size)
    scheduler.chunk_budget = sizer.budget
    return sizer


def _mix(old: float | None, new: float) -> float:
    return new if old is None else (1.0 - WEIGHT) * old + WEIGHT * new
