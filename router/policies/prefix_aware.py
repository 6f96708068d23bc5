"""`prefix-aware`: each candidate is scored by the prompt tokens it must still compute, from the
prefix cache it holds (the snapshot's `cached`: the router's PrefixIndex, fed by the workers' KV
events, asked once per snapshot), weighed against its load, and the cheapest wins:
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
from typing import ClassVar

from tandem.contracts.names import Role
from tandem.contracts.routing import RouteReason
from tandem.router.policies.base import (
    PairedPolicy,
    RequestInfo,
    Route,
    Snapshot,
    WorkerView,
    decode_seqs,
    queued_prompt_tokens,
)


class PrefixAware(PairedPolicy):
    uses_prefix_index: ClassVar[bool] = True

    def prefill_cost(self, request: RequestInfo, w: WorkerView, snap: Snapshot) -> int:
        return queued_prompt_tokens(w) + request.prompt_tokens - snap.cached_tokens(w)

    def decode_cost(self, request: RequestInfo, w: WorkerView, snap: Snapshot) -> int:
        load = self.settings.prefix_sequence_cost_tokens * decode_seqs(w)
        return load + request.prompt_tokens - snap.cached_tokens(w)

    def pick_prefill(self, request: RequestInfo, candidates: list[WorkerView], snap: Snapshot) -> WorkerView:
        return min(candidates, key=lambda w: (self.prefill_cost(request, w, snap), w.running + w.waiting))

    def pick_decode(self, request: RequestInfo, candidates: list[WorkerView], snap: Snapshot) -> WorkerView:
        return min(candidates, key=lambda w: (self.decode_cost(request, w, snap), w.kv_usage))

    def route(self, request: RequestInfo, snap: Snapshot) -> Route | None:
        usable = [w for w in snap.workers if w.ready]
        decode = [w for w in usable if w.serves_decode]
        if request.pinned is None and decode and any(w.role is Role.PREFILL for w in usable):
            d = self.pick_decode(request, decode, snap)
            held = snap.cached_tokens(d)
            if held and request.prompt_tokens - held < self.settings.short_prompt_threshold:
                return Route(d, None, RouteReason.CACHED_PREFIX, cached_decode_tokens=held)
        route = super().route(request, snap)
        if route is None:
            return None
        return dataclasses.replace(
            route, cached_decode_tokens=snap.cached_tokens(route.decode),
            cached_prefill_tokens=snap.cached_tokens(route.prefill) if route.prefill is not None else 0)
