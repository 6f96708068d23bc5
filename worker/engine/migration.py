"""Migration (decode role): what a draining engine hands out with a sequence that leaves it.

On SIGTERM a decode worker calls Engine.start_migration(); at the start of its next step the engine
takes every sequence out of the scheduler (never while a step is in flight). One that has generated
and holds KV for all but its last token is MIGRATING: its blocks are leased (leases.py) exactly as a
prefill result's are, for another decode worker to pull; the rest (queued, mid-prefill) leave
FINISHED_MIGRATED without KV and are recomputed elsewhere. Each gets a last output with `migrated` set
(worker/server/generate.py turns it into a MIGRATE line).
"""

from __future__ import annotations

import logging

from tandem.contracts.kv_layout import KVLayout
from tandem.worker.engine.request_state import RequestState
from tandem.worker.engine.request_table import RequestTable
from tandem.worker.engine.scheduler import Scheduler
from tandem.worker.engine.sequence import EngineSequence, SeqOutput

log = logging.getLogger("tandem.worker.engine")


def kv_to_hand_out(seq: EngineSequence, layout: KVLayout) -> list[int] | None:
    """The blocks whose KV a leaving sequence takes along (all its tokens but the last, whose KV the
    next step would compute), or None when it has none worth moving (nothing generated yet, or a
    prompt not fully computed): it is then recomputed elsewhere."""
    kv_blocks = layout.blocks_for(seq.num_computed)
    if seq.decoding and len(seq.block_table) >= kv_blocks:
        return seq.block_table[:kv_blocks]
    return None


def hand_out(requests: RequestTable, scheduler: Scheduler, layout: KVLayout,
             migrated_out: dict[str, int]) -> list[tuple[EngineSequence, SeqOutput]]:
    """Under the engine's lock: every queued or running sequence but a prefill's leaves the
    scheduler, MIGRATING with its KV leased or FINISHED_MIGRATED with its blocks freed; counted by how
    in `migrated_out`. The outputs to emit once the lock is let go."""
    emits = []
    for seq in [s for s in requests.in_states(RequestState.WAITING, RequestState.RUNNING) if not s.prefill_only]:
        scheduler.take_out(seq)
        kv_blocks = kv_to_hand_out(seq, layout)
        if kv_blocks is not None:
            requests.lease(seq, RequestState.MIGRATING)
        else:
            scheduler.free_blocks(seq)
            requests.move(seq, RequestState.FINISHED_MIGRATED)
        how = "recompute" if kv_blocks is None else "kv"
        migrated_out[how] = migrated_out.get(how, 0) + 1
        log.info("migrating out (%s)", how, extra={"request_id": seq.request_id})
        emits.append((seq, SeqOutput(seq.request_id, migrated=True, kv_blocks=kv_blocks)))
    return emits
