"""`least-loaded`: prefill on the worker with the fewest outstanding prompt tokens, decode on the one
with the fewest running + waiting sequences, then the lowest KV usage. Router-side in-flight counts
fill the gap between two polls of /internal/info."""

from __future__ import annotations

from tandem.router.policies.base import (
    PairedPolicy,
    RequestInfo,
    Snapshot,
    WorkerView,
    decode_load,
    prefill_load,
)


class LeastLoaded(PairedPolicy):
    def pick_prefill(self, request: RequestInfo, candidates: list[WorkerView], snap: Snapshot) -> WorkerView:
        return min(candidates, key=prefill_load)

    def pick_decode(self, request: RequestInfo, candidates: list[WorkerView], snap: Snapshot) -> WorkerView:
        return min(candidates, key=decode_load)
