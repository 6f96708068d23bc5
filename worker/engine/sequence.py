"""One request's state inside the engine: its tokens, how many have KV in the pool, its blocks."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.contracts.protocol import FinishReason, SamplingParams


class SeqStatus(enum.StrEnum):
    WAITING = "waiting"  # queued (new, or preempted and waiting to be recomputed)
    RUNNING = "running"  # in the running batch
    LEASED = "leased"  # first token out (prefill) or migrated: blocks kept until a peer pulls them
    FINISHED = "finished"


@dataclass
class SeqOutput:
    """What one engine step produced for one sequence, handed to the request's sink."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: dict[str, Any] | None = None
    # The leased blocks holding the KV: a prefill's prompt, or a migrated sequence's computed tokens
    kv_blocks: list[int] | None = None
    migrated: bool = False  # the engine is draining: the sequence left it (kv_blocks: leased KV, if any)
    logprobs: list[Any] | None = None  # TokenLogprobs per token_ids entry, when the request asked


@dataclass(eq=False)  # identity: queues find and remove *this* sequence
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_total_len: int  # context length: prompt + output never exceeds it
    seed: int  # per-request; the sample at output index i uses a generator seeded from (seed, i)
    eos_ids: frozenset[int] = frozenset()
    output_ids: list[int] = field(default_factory=list)
    prefill_only: bool = False  # prefill role: stop after the first token and lease the blocks
    arrival: float = 0.0
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # tokens of all_ids whose K/V are in the pool
    block_table: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    detok: Any = None  # IncrementalDetokenizer, set by the engine
    sink: Callable[[SeqOutput], None] | None = None
    finish_reason: FinishReason | None = None
    num_resumed: int = 0  # generated tokens given by the request (resume); not emitted again
    # Prefix cache (prefix_cache.py): hashes of the full blocks of all_ids computed so far, and
    # how many leading blocks of block_table are named in the cache (or were tried).
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    num_registered_blocks: int = 0
    stop_ids: frozenset[int] = frozenset()  # params.stop_token_ids, for a constant-time check per token
    grammar: Any = None  # grammar.Grammar of a structured output, advanced with every token taken
    sampled_logprobs: Any = None  # the TokenLogprobs of the token just sampled (batch.py), until taken

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens still to run through the model before the next sample."""
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status == SeqStatus.FINISHED
