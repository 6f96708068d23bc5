"""Migration (decode role): a draining engine hands its running sequences out between steps.

On SIGTERM a decode worker calls start_migration(); at the start of its next step the engine takes
every sequence out of the scheduler. One that has generated and holds KV for all but its last
token has its blocks leased (leases.py) exactly as a prefill result's are, for another decode
worker to pull; the rest (queued, mid-prefill) leave without KV and are recomputed elsewhere.
Each gets a last output with `migrated` set (worker/server/generate.py turns it into a MIGRATE
line). Mixed into `Engine`, whose lock, scheduler and lease table it uses.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from tandem.contracts.kv_layout import KVLayout
from tandem.worker.engine.prefix_cache import PublishingLock
from tandem.worker.engine.request_state import RequestState
from tandem.worker.engine.scheduler import Scheduler
from tandem.worker.engine.sequence import SeqOutput, Sequence

log = logging.getLogger("tandem.worker.engine")


class Migration:
    """The hand-out half of the engine (attributes set by Engine.__init__)."""

    lock: PublishingLock
    scheduler: Scheduler
    layout: KVLayout
    seqs: dict[str, Sequence]
    stats: Any
    _migrating: bool
    _lease: Callable[[Sequence, RequestState], None]
    _emit: Callable[[Sequence, SeqOutput], None]

    def start_migration(self) -> None:
        """From now on every sequence (but a prefill's) leaves at the start of the next step, so
        never while a step is in flight: one that has generated and holds KV for all but its last
        token has its blocks leased like a prefill result's; the rest leave without KV (the router
        recomputes them). Their outputs say `migrated`."""
        with self.lock:
            self._migrating = True

    def _hand_out(self) -> None:
        emits = []
        with self.lock:
            for seq in [s for s in self.seqs.values() if not s.prefill_only and s.status != RequestState.PULLING]:
                emits.append((seq, self._migrate_out(seq)))
        for seq, out in emits:
            self._emit(seq, out)

    def _migrate_out(self, seq: Sequence) -> SeqOutput:
        """Under the lock: seq leaves the engine, its KV leased when it has some worth moving."""
        self.scheduler.take_out(seq)
        del self.seqs[seq.request_id]
        kv_blocks = self.layout.blocks_for(seq.num_computed)
        if seq.output_ids and seq.num_pending == 1 and len(seq.block_table) >= kv_blocks:
            self._lease(seq, RequestState.MIGRATING)
            how, out = "kv", SeqOutput(seq.request_id, migrated=True, kv_blocks=seq.block_table[:kv_blocks])
        else:
            self.scheduler.free_blocks(seq)
            seq.status = RequestState.FINISHED
            how, out = "recompute", SeqOutput(seq.request_id, migrated=True)
        self.stats.migrated_out[how] = self.stats.migrated_out.get(how, 0) + 1
        log.info("migrating out (%s)", how, extra={"request_id": seq.request_id})
        return out

