"""`round-robin`: each pool's workers take turns, whatever their load (the baseline to compare a
load-aware policy against, and predictable for tests). Pairing and fallbacks as every policy.

The cursor is the snapshot's (`Snapshot.turns`: how many choices the router has made in that pool),
not this object's: the worker set moves it on for each choice an action makes (`Action.turns`), so
deciding twice over the same snapshot gives the same worker."""

from __future__ import annotations

from tandem.contracts.names import Role
from tandem.router.policies.base import PairedPolicy, RequestInfo, Snapshot, WorkerView


def _turn(pool: Role, candidates: list[WorkerView], snap: Snapshot) -> WorkerView:
    ordered = sorted(candidates, key=lambda w: w.url)
    return ordered[snap.turn(pool) % len(ordered)]


class RoundRobin(PairedPolicy):
    def pick_prefill(self, request: RequestInfo, candidates: list[WorkerView], snap: Snapshot) -> WorkerView:
        return _turn(Role.PREFILL, candidates, snap)

    def pick_decode(self, request: RequestInfo, candidates: list[WorkerView], snap: Snapshot) -> WorkerView:
        return _turn(Role.DECODE, candidates, snap)
