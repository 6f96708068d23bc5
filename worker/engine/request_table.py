"""The request table: the one owner of every request a worker's engine holds, and the only writer of
a request's state.

It holds the claims (ids with a queue place and no sequence yet), the sequences being pulled, queued
or run, the leases (leases.py: LEASED and MIGRATING sequences whose blocks wait for a peer), and the
ids inside the step in flight. `move` is the one way a state changes: it checks the move against
request_state.TRANSITIONS (anything else is a bug, raised as IllegalTransition, never papered over)
and keeps the collections in step with the states, so "which requests are pulling" and "is this id
in use" have one answer each. The engine calls it under its lock; the scheduler through the table
it was given. tests/worker/engine/test_only_the_request_table_writes_a_state.py fails on any other
writer.
"""

from __future__ import annotations

from collections.abc import Iterator

from tandem.worker.engine.leases import Lease, LeaseTable
from tandem.worker.engine.request_state import TRANSITIONS, RequestState
from tandem.worker.engine.sequence import EngineSequence

S = RequestState
_HELD = frozenset({S.PULLING, S.WAITING, S.RUNNING, S.ABORTING})  # in `seqs`


class IllegalTransition(RuntimeError):
    """A move request_state.TRANSITIONS does not allow: a bug in the engine, not in the request."""


def _check(seq: EngineSequence, to: RequestState) -> None:
    if to not in TRANSITIONS.get(seq.status, ()):
        raise IllegalTransition(f"request {seq.request_id!r}: {seq.status} -> {to} is not a move a request makes")


class RequestTable:
    def __init__(self, lease_s: float = 30.0):
        self.claims: set[str] = set()  # CLAIMED (admission.py holds the policy over them)
        self._seqs: dict[str, EngineSequence] = {}  # PULLING, WAITING, RUNNING, ABORTING
        self.leases = LeaseTable(lease_s)  # LEASED, MIGRATING
        self.in_flight: frozenset[str] = frozenset()  # the ids in the forward pass running now

    def move(self, seq: EngineSequence, to: RequestState) -> None:
        """The one writer of a state: seq moves to `to` if TRANSITIONS allows it, else IllegalTransition.
        A sequence entering a held state is held; one leaving for a final or leased state is let go
        (a lease is added by `lease`, taken by `end_lease`)."""
        _check(seq, to)
        if to.holds_lease and seq.request_id not in self.leases:
            raise IllegalTransition(f"request {seq.request_id!r}: {to} without a lease (RequestTable.lease)")
        seq._status = to  # noqa: SLF001 - the one writer
        if to in _HELD:
            self._seqs[seq.request_id] = seq
        else:
            self._seqs.pop(seq.request_id, None)

    def lease(self, seq: EngineSequence, to: RequestState, now: float | None = None) -> Lease:
        """seq (WAITING or RUNNING) -> LEASED or MIGRATING: its blocks wait in the lease table."""
        if not to.holds_lease:
            raise IllegalTransition(f"request {seq.request_id!r}: {to} holds no lease")
        _check(seq, to)  # before the lease is added: a refused move leaves no lease behind
        lease = self.leases.add(seq, now)
        self.move(seq, to)
        return lease

    def end_lease(self, request_id: str, token: str | None, *, aborted: bool = False) -> Lease | None:
        """Take a lease out when `token` proves it (None: the engine itself): its sequence is
        FINISHED_ABORTED if `aborted`, else FINISHED_HANDED_OFF (a prefill's) or FINISHED_MIGRATED;
        its blocks are the caller's to free. None for a wrong token or no lease."""
        lease = self.leases.take(request_id, token)
        if lease is not None:
            seq = lease.seq
            done = S.FINISHED_ABORTED if aborted else (
                S.FINISHED_HANDED_OFF if seq.status is S.LEASED else S.FINISHED_MIGRATED)
            self.move(seq, done)
        return lease

    # ---- views --------------------------------------------------------------------------

    @property
    def seqs(self) -> dict[str, EngineSequence]:
        """The held sequences by id (PULLING, WAITING, RUNNING, ABORTING): a view, not to be written."""
        return self._seqs

    def state_of(self, request_id: str) -> RequestState | None:
        """Where request_id is here: CLAIMED, a held or leased sequence's state, or None (not here)."""
        if request_id in self.claims:
            return S.CLAIMED
        if (seq := self._seqs.get(request_id)) is not None:
            return seq.status
        return self.leases[request_id].seq.status if request_id in self.leases else None

    def holds(self, request_id: str) -> bool:
        """A sequence or a lease of that id is here (a claim is admission's to count)."""
        return request_id in self._seqs or request_id in self.leases

    def in_states(self, *states: RequestState) -> Iterator[EngineSequence]:
        return (s for s in list(self._seqs.values()) if s.status in states)

    def __bool__(self) -> bool:
        return bool(self._seqs or self.leases or self.claims)
