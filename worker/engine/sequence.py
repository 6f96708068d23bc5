"""One request's state inside the engine: its tokens, how many have KV in the pool, its blocks."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.contracts.protocol import FinishReason
from tandem.contracts.sampling import SamplingParams
from tandem.worker.engine.request_state import RequestState

log = logging.getLogger("tandem.worker.engine")


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

    @classmethod
    def engine_error(cls, request_id: str, error: Exception) -> SeqOutput:
        """The last output of a sequence the engine failed on (its own input broke a step)."""
        return cls(request_id, finished=True, finish_reason=FinishReason.ERROR,
                   error={"message": f"the engine failed on this request: {error}",
                          "type": "internal_error", "param": None, "code": "engine_error"})


@dataclass(eq=False)  # identity: queues find and remove *this* sequence
class EngineSequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_total_len: int  # context length: prompt + output never exceeds it
    seed: int  # per-request; the sample at output index i uses a generator seeded from (seed, i)
    eos_ids: frozenset[int] = frozenset()
    output_ids: list[int] = field(default_factory=list)
    prefill_only: bool = False  # prefill role: stop after the first token and lease the blocks
    arrival: float = 0.0
    num_computed: int = 0  # tokens of all_ids whose K/V are in the pool
    block_table: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    detok: Any = None  # IncrementalDetokenizer, set by the engine
    sink: Callable[[SeqOutput], None] | None = None
    num_resumed: int = 0  # generated tokens given by the request (resume); not emitted again
    # Prefix cache (prefix_cache.py): hashes of the full blocks of all_ids computed so far, and
    # how many leading blocks of block_table are named in the cache (or were tried).
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    num_registered_blocks: int = 0
    stop_ids: frozenset[int] = frozenset()  # params.stop_token_ids, for a constant-time check per token
    cache_salt: str | None = None  # the request's prefix-cache salt: its blocks match only the same salt's
    flow: str = ""  # the request's tenant (GenerateRequest.fairness_id): the scheduler's fair share
    priority: int = 0  # higher prompts are prefilled first (GenerateRequest.priority)
    grammar: Any = None  # grammar.Grammar of a structured output, advanced with every token taken
    # Written by the request table alone (request_table.py), along request_state.TRANSITIONS.
    _status: RequestState = field(default=RequestState.NEW, init=False)

    @property
    def status(self) -> RequestState:
        return self._status

    @property
    def finish_reason(self) -> FinishReason | None:
        return self._status.finish_reason

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
    def decoding(self) -> bool:
        """Its next step computes one generated token: a decode. Otherwise it has a prompt (a
        one-token prompt too), a preempted sequence's tokens or replayed ones to prefill: the one
        answer the scheduler, the chunk sizer, the stats and migration go by."""
        return self.num_pending == 1 and bool(self.output_ids)

    @property
    def finished(self) -> bool:
        return self._status.is_finished

    def emit(self, out: SeqOutput) -> None:
        """Hand an output to the request's listener; its failure stays its own."""
        if self.sink is None:
            return
        try:
            self.sink(out)
        except Exception:  # noqa: BLE001 - one listener's failure must not stop the others' outputs
            log.exception("delivering an output failed", extra={"request_id": self.request_id})
