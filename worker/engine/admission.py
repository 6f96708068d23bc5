"""Admission control: which requests may come in. An id is unique across every state a request can
be in here (claimed, pulling, waiting, running, leased, migrating: 409), and the requests waiting
for a seat are bounded beyond the free seats (429 with a retry hint, so a full worker is busy,
never failed).

A request is *claimed* before any work is done for it (tokenizing, reserving blocks, pulling its
KV): the claim holds its id and a place in the queue, so a duplicate or a full queue is refused
first; it ends when the request is queued (`take`) or given up (`unclaim`). What the engine holds
otherwise (ids in use, the running batch, the queues) is read through the two functions it passes
in; the engine calls this under its lock.
"""

from __future__ import annotations

from collections.abc import Callable

from tandem.contracts import timing
from tandem.worker.engine.errors import RequestError


class AdmissionControl:
    def __init__(self, max_num_seqs: int, max_waiting: int, *, in_use: Callable[[str], bool],
                 load: Callable[[], tuple[int, int]], claims: set[str] | None = None):
        """`in_use(request_id)`: the engine holds a sequence or a lease of that id; `load()`:
        (sequences running, sequences queued for a seat); `claims`: where the claims are kept (the
        engine's request table, request_table.py), else a set of its own."""
        if max_num_seqs < 1 or max_waiting < 0:
            raise ValueError("max_num_seqs must be >= 1 and max_waiting >= 0")
        self.max_num_seqs = max_num_seqs
        self.max_waiting = max_waiting
        self._in_use = in_use
        self._load = load
        self._claims = claims if claims is not None else set()

    @property
    def num_claims(self) -> int:
        """Requests admitted and not queued yet (being tokenized, or their KV pulled)."""
        return len(self._claims)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._claims

    def claim(self, request_id: str) -> None:
        """Hold the id and a queue place; RequestError 409 for an id in use here, 429 when full."""
        self._check(request_id)
        self._claims.add(request_id)

    def take(self, request_id: str) -> None:
        """The request is queued now: its claim ends, or (never claimed) it is admitted now."""
        if request_id in self._claims:
            self._claims.discard(request_id)
        else:
            self._check(request_id)

    def unclaim(self, request_id: str) -> None:
        """Let go of a claim that never became a queued request; a no-op once taken."""
        self._claims.discard(request_id)

    def _check(self, request_id: str) -> None:
        if request_id in self._claims or self._in_use(request_id):
            raise RequestError(f"request {request_id!r} is already running here",
                               status=409, param="request_id", code="duplicate_request_id")
        running, queued = self._load()
        waiting = queued + len(self._claims)
        free_seats = max(0, self.max_num_seqs - running)
        if waiting >= free_seats + self.max_waiting:
            raise RequestError(f"this worker is full: {running} sequences run and {waiting} wait (at most "
                               f"{self.max_waiting}): retry shortly or elsewhere", status=429,
                               type_="service_unavailable", code="queue_full",
                               retry_after_s=timing.WORKER_RETRY_AFTER_S)
