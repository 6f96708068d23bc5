"""The states of a request inside a worker, from admission to its end: the one place that says where
a request is and what moves it on (SGLang's disaggregation/decode.py keeps the same kind of list).

Before it has a state a request is *claimed* (`Engine.claim`): its id and a queue place are held
before any work, so a duplicate (409) or a full queue (429) is refused first; then its prompt is
tokenized (off the event loop) and its parameters checked, and it enters WAITING or PULLING.

    from               to          when                                             by
    (claimed)          WAITING     a prompt to prefill here                         Engine.add
    (claimed)          PULLING     a handoff: blocks reserved for its KV            Engine.begin_pull
    PULLING            WAITING     its KV is here: it waits for a seat with it      Engine.finish_pull
    PULLING            FINISHED    the pull failed (or it was aborted meanwhile)    Engine.fail_pull
    PULLING            WAITING     its KV failed verification: prefilled here       Engine.fail_pull(requeue)
    WAITING            RUNNING     seated (a pulled one decodes in that step)       Scheduler.schedule
    RUNNING            WAITING     preempted: blocks freed, recomputed later        Scheduler.schedule
    RUNNING            LEASED      prefill role: first token out, blocks kept       Engine.step
    WAITING, RUNNING   MIGRATING   draining: handed out between steps, KV kept      Engine.step
    WAITING, RUNNING   FINISHED    a stop rule, an error, abort, withdraw, or a
                                   hand-out without KV worth moving                 Engine.step/abort
    LEASED, MIGRATING  FINISHED    pulled, released or aborted with its token,
                                   expired, or never handed out                     Engine.release_lease

- WAITING: queued for a seat in the running batch: a new prompt, a preempted sequence to be
  recomputed, or one whose KV was pulled (it holds its blocks while it waits).
- PULLING: blocks reserved for the KV of all but its last token while the KV transport reads them
  from a peer's lease (vLLM's WAITING_FOR_REMOTE_KVS); the engine-driven stage of kv_pull.py. A
  READ that may still land after a failure keeps its blocks until it is known to have stopped.
- RUNNING: in the batch; each step computes a prompt chunk or one token for it.
- LEASED (prefill role) and MIGRATING (a draining decode worker): its blocks wait in the lease
  table (leases.py) for another worker's pull, proven by the lease's token.
- FINISHED: its blocks are back in the pool (cached ones stay named for the prefix cache).

Ending something has one verb per meaning (engine.py): `abort` cancels a request in any state (a
lease handed out needs its token; a request inside a step or a pull ends when that step or pull
does, even if that step leased it: nobody has that lease's token yet); `withdraw` takes back a request that has not started (its caller stopped waiting);
`release_lease` is a peer saying it is done with a lease, proven by its token; `expire_leases`
ends the leases nobody came for; `unclaim` lets go of a claim that never became a sequence.
"""

from __future__ import annotations

import enum


class RequestState(enum.StrEnum):
    WAITING = "waiting"  # queued for a seat: to prefill here, recompute, or with its KV pulled
    PULLING = "pulling"  # blocks reserved, its KV being read from a peer
    RUNNING = "running"  # in the running batch
    LEASED = "leased"  # prefill role: first token out, blocks kept until a peer pulls them
    MIGRATING = "migrating"  # draining decode role: handed out, KV kept until another decode pulls it
    FINISHED = "finished"

    @property
    def holds_lease(self) -> bool:
        return self in (RequestState.LEASED, RequestState.MIGRATING)
