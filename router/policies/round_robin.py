"""`round-robin`: each pool's workers take turns, whatever their load (the baseline to compare a
load-aware policy against, and predictable for tests). Pairing and fallbacks as every policy."""

from __future__ import annotations

from collections import Counter

from tandem.router.policies.base import PairedPolicy, PolicySettings, RequestInfo, WorkerView


class RoundRobin(PairedPolicy):
    def __init__(self, settings: PolicySettings | None = None) -> None:
        super().__init__(settings)
        self._turns: Counter[str] = Counter()

    def _next(self, pool: str, candidates: list[WorkerView]) -> WorkerView:
        ordered = sorted(candidates, key=lambda w: w.url)
        turn = self._turns[pool]
        self._turns[pool] += 1
        return ordered[turn % len(ordered)]

    def pick_prefill(self, request: RequestInfo, candidates: list[WorkerView]) -> WorkerView:
        return self._next("prefill", candidates)

    def pick_decode(self, request: RequestInfo, candidates: list[WorkerView]) -> WorkerView:
        return self._next("decode", candidates)
