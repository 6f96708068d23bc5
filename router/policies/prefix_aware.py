"""`prefix-aware`: each candidate is scored by the prompt tokens it must still compute, from the
prefix cache it holds (the router's PrefixIndex, fed by the workers' KV events), weighed against
its load, and the cheapest wins:
- a prefill worker costs the prompt tokens queued there plus the prompt's tokens it does not hold;
- a decode worker costs `prefix_sequence_cost_tokens` per sequence running or waiting there plus the
  prompt's tokens it does not hold (what it would compute, or pull, and then hold for the next
  turn of the conversation).
So a conversation's later turns go back to the workers holding its earlier turns, and a hot
prefix spreads once the worker holding it has more work queued than the prefix saves.

When the best decode worker already holds all but fewer than `short_prompt_threshold` tokens of
the prompt (a chat's next turn on the worker that decoded the last one), it prefills that tail
itself: route `cached_prefix`, no prefill worker and no handoff. Without token ids (no router
tokenizer) nothing is cached and this is least-loaded in other units. Pairing, the short-prompt
bypass and load-aware disaggregation are PairedPolicy's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import ClassVar

from tandem.contracts.names import Role
from tandem.contracts.routing import RouteReason
from tandem.router.policies.base import (
    PairedPolicy,
    Plan,
    RequestInfo,
    WorkerView,
    decode_seqs,
    queued_prompt_tokens,
)


class PrefixAware(PairedPolicy):
    uses_prefix_index: ClassVar[bool] = True

    def cached(self, request: RequestInfo, w: WorkerView) -> int:
        """Leading prompt tokens `w` holds (0 without an index or token ids)."""
        index = self.settings.prefix_index
        return index.cached_tokens(w.url, request) if index is not None else 0

    def prefill_cost(self, request: RequestInfo, w: WorkerView) -> int:
        return queued_prompt_tokens(w) + request.prompt_tokens - self.cached(request, w)

    def decode_cost(self, request: RequestInfo, w: WorkerView) -> int:
        return self.settings.prefix_sequence_cost_tokens * decode_seqs(w) + request.prompt_tokens - self.cached(request, w)

    def pick_prefill(self, request: RequestInfo, candidates: list[WorkerView]) -> WorkerView:
        return min(candidates, key=lambda w: (self.prefill_cost(request, w), w.running + w.waiting))

    def pick_decode(self, request: RequestInfo, candidates: list[WorkerView]) -> WorkerView:
        return min(candidates, key=lambda w: (self.decode_cost(request, w), w.kv_usage))

    def plan(self, request: RequestInfo, workers: Sequence[WorkerView]) -> Plan | None:
        usable = [w for w in workers if w.ready]
        decode = [w for w in usable if w.serves_decode]
        if decode and any(w.role is Role.PREFILL for w in usable):
            d = self.pick_decode(request, decode)
            held = self.cached(request, d)
            if held and request.prompt_tokens - held < self.settings.short_prompt_threshold:
                return Plan(d, None, RouteReason.CACHED_PREFIX, cached_decode_tokens=held)
        plan = super().plan(request, workers)
        if plan is None:
            return None
        return dataclasses.replace(
            plan, cached_decode_tokens=self.cached(request, plan.decode),
            cached_prefill_tokens=self.cached(request, plan.prefill) if plan.prefill is not None else 0)
