"""Migration (decode role): what a draining engine hands out with a sequence that leaves it.

On SIGTERM a decode worker calls Engine.start_migration(); at the start of its next step the engine
takes every sequence out of the scheduler (never while a step is in flight). One that has generated
and holds KV for all but its last token is MIGRATING: its blocks are leased (leases.py) exactly as a
prefill result's are, for another decode worker to pull; the rest (queued, mid-prefill) leave
FINISHED without KV and are recomputed elsewhere. Each gets a last output with `migrated` set
(worker/server/generate.py turns it into a MIGRATE line).
"""

from __future__ import annotations

from tandem.contracts.kv_layout import KVLayout
from tandem.worker.engine.sequence import Sequence


def kv_to_hand_out(seq: Sequence, layout: KVLayout) -> list[int] | None:
    """The blocks whose KV a leaving sequence takes along (all its tokens but the last, whose KV the
    next step would compute), or None when it has none worth moving (nothing generated yet, or a
    prompt not fully computed): it is then recomputed elsewhere."""
    kv_blocks = layout.blocks_for(seq.num_computed)
    if seq.output_ids and seq.num_pending == 1 and len(seq.block_table) >= kv_blocks:
        return seq.block_table[:kv_blocks]
    return None
