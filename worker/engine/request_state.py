"""The states of a request inside a worker, from admission to its end, and the one map of the moves
allowed between them (vLLM's `RequestStatus` folds the finish reasons into the final states the same
way; SGLang's disaggregation/decode.py keeps the same kind of list). Only the request table
(request_table.py) writes a state, and only along this map.

A request is first *claimed* (`Engine.claim`, the table's CLAIMED: an id and a queue place, no
sequence yet), so a duplicate (409) or a full queue (429) is refused before any work; then its prompt
is tokenized (off the event loop) and its parameters checked (NEW: a sequence the engine does not
hold yet), and it enters WAITING or PULLING.

    from               to                 when                                              by
    NEW                WAITING            a prompt to prefill here                          Engine.add
    NEW                PULLING            a handoff: blocks reserved for its KV             Engine.begin_pull
    NEW                FINISHED_STOPPED,  the tokens it generated elsewhere already end it  Engine.make_sequence
                       FINISHED_LENGTH
    PULLING            WAITING            its KV is here (or failed verification: it is     Engine.finish_pull,
                                          prefilled here): it waits for a seat              Engine.fail_pull
    PULLING            FINISHED_ERROR     the pull failed                                   Engine.fail_pull
    PULLING, RUNNING   ABORTING           aborted while its pull or its step is in flight   Engine.abort
    ABORTING           FINISHED_ABORTED   that pull or step is over                         Engine.step/finish_pull
    WAITING            RUNNING            seated (a pulled one decodes in that step)        Scheduler.schedule
    RUNNING            WAITING            preempted: blocks freed, recomputed later         Scheduler.schedule
    RUNNING            LEASED             prefill role: first token out, blocks kept        Engine.step
    WAITING, RUNNING   MIGRATING          draining: handed out between steps, KV kept       Engine.step
    WAITING, RUNNING   FINISHED_MIGRATED  draining, with no KV worth moving: recomputed     Engine.step
                                          elsewhere
    WAITING            FINISHED_WITHDRAWN its caller stopped waiting before it started      Engine.withdraw
    WAITING, RUNNING   FINISHED_STOPPED,  a stop rule, max_tokens or the context, abort,    Engine.step/abort
                       _LENGTH, _ABORTED, an error of its own
                       _ERROR
    LEASED             FINISHED_HANDED_OFF pulled, released or expired                      Engine.release_lease
    MIGRATING          FINISHED_MIGRATED  pulled, released or expired                       Engine.release_lease
    LEASED, MIGRATING  FINISHED_ABORTED   aborted with its lease's token                    Engine.abort

- WAITING: queued for a seat in the running batch: a new prompt, a preempted sequence to be
  recomputed, or one whose KV was pulled (it holds its blocks while it waits).
- PULLING: blocks reserved for the KV of all but its last token while the KV transport reads them
  from a peer's lease (vLLM's WAITING_FOR_REMOTE_KVS); the engine-driven stage of kv_pull.py. A
  READ that may still land after a failure keeps its blocks until it is known to have stopped.
- RUNNING: in the batch; each step computes a prompt chunk or one token for it.
- ABORTING: aborted while something outside the engine's lock works on it (a forward pass, a KV
  read); whoever finishes that work ends it (a step never leases a sequence aborted inside it).
- LEASED (prefill role) and MIGRATING (a draining decode worker): its blocks wait in the lease
  table (leases.py) for another worker's pull, proven by the lease's token.
- FINISHED_*: its blocks are back in the pool (cached ones stay named for the prefix cache); the
  four that answer a client are its FinishReason (`finish_reason`).

Ending something has one verb per meaning (engine.py): `abort` cancels a request in any state (a
lease handed out needs its token); `withdraw` takes back a request that has not started (its caller
stopped waiting); `release_lease` is a peer saying it is done with a lease, proven by its token;
`expire_leases` ends the leases nobody came for; `unclaim` lets go of a claim that never became a
sequence.
"""

from __future__ import annotations

import enum

from tandem.contracts.protocol import FinishReason


class RequestState(enum.StrEnum):
    CLAIMED = "claimed"  # an id and a queue place held, no sequence yet (the request table's claims)
    NEW = "new"  # a sequence made (tokenized, checked), not held by the engine yet
    WAITING = "waiting"  # queued for a seat: to prefill here, recompute, or with its KV pulled
    PULLING = "pulling"  # blocks reserved, its KV being read from a peer
    RUNNING = "running"  # in the running batch
    ABORTING = "aborting"  # aborted while its step or pull is in flight: ends when that does
    LEASED = "leased"  # prefill role: first token out, blocks kept until a peer pulls them
    MIGRATING = "migrating"  # draining decode role: handed out, KV kept until another decode pulls it
    FINISHED_STOPPED = "finished_stopped"  # EOS, a stop token or string, a grammar's end
    FINISHED_LENGTH = "finished_length"  # max_tokens or the context length
    FINISHED_ABORTED = "finished_aborted"  # cancelled by its client or the router
    FINISHED_ERROR = "finished_error"  # its own input broke a step, or its KV pull failed
    FINISHED_HANDED_OFF = "finished_handed_off"  # a prefill's lease ended: pulled, released or expired
    FINISHED_MIGRATED = "finished_migrated"  # left a draining engine (its lease ended, or none)
    FINISHED_WITHDRAWN = "finished_withdrawn"  # taken back before it started

    @property
    def holds_lease(self) -> bool:
        return self in (RequestState.LEASED, RequestState.MIGRATING)

    @property
    def is_finished(self) -> bool:
        return self.value.startswith("finished_")

    @property
    def finish_reason(self) -> FinishReason | None:
        """The reason a client is told, for the four final states that answer one."""
        return _REASONS.get(self)

    @staticmethod
    def finished(reason: FinishReason) -> RequestState:
        """The final state of a sequence the engine ends for `reason`."""
        return next(state for state, r in _REASONS.items() if r is reason)


S = RequestState
_REASONS = {S.FINISHED_STOPPED: FinishReason.STOP, S.FINISHED_LENGTH: FinishReason.LENGTH,
            S.FINISHED_ABORTED: FinishReason.ABORT, S.FINISHED_ERROR: FinishReason.ERROR}
_ENDS = frozenset(_REASONS)  # what a stop rule, an abort or an error does to a waiting or running one

# Every move a request may make (the table in the docstring); anything else is a bug in the engine.
TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    S.NEW: frozenset({S.WAITING, S.PULLING, S.FINISHED_STOPPED, S.FINISHED_LENGTH}),
    S.PULLING: frozenset({S.WAITING, S.ABORTING, S.FINISHED_ERROR}),
    S.WAITING: frozenset({S.RUNNING, S.MIGRATING, S.FINISHED_MIGRATED, S.FINISHED_WITHDRAWN} | _ENDS),
    S.RUNNING: frozenset({S.WAITING, S.ABORTING, S.LEASED, S.MIGRATING, S.FINISHED_MIGRATED} | _ENDS),
    S.ABORTING: frozenset({S.FINISHED_ABORTED}),
    S.LEASED: frozenset({S.FINISHED_HANDED_OFF, S.FINISHED_ABORTED}),
    S.MIGRATING: frozenset({S.FINISHED_MIGRATED, S.FINISHED_ABORTED}),
}
