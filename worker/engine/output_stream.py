"""One request's outputs as the engine delivers them to the event loop, read in batches."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tandem.worker.engine.output_processor import final_text
from tandem.worker.engine.sequence import EngineSequence, SeqOutput


class OutputStream:
    """One sequence's outputs as the engine delivers them, read in batches: whatever arrived while
    the reader was busy comes at once (one write for a stream that lags), and a wait for the next
    one has a timeout without a task of its own (the reader sends heartbeats meanwhile)."""

    def __init__(self, seq: EngineSequence, q: asyncio.Queue[SeqOutput], abort: Callable[[str], object]):
        self.seq = seq
        self.request_id = seq.request_id
        self._q = q
        self._abort = abort
        self.done = False  # the last output (finished, migrated, or the lease of a prefill) was read

    async def get(self, timeout_s: float) -> list[SeqOutput]:
        """The outputs that arrived, waiting up to timeout_s for the first; [] when none came."""
        q = self._q
        outs = []
        if q.empty():
            try:
                async with asyncio.timeout(timeout_s):
                    outs.append(await q.get())
            except TimeoutError:
                return []
        while not q.empty():
            outs.append(q.get_nowait())
        self.done = self.done or any(o.finished or o.migrated or o.kv_blocks is not None for o in outs)
        return outs

    def close(self) -> None:
        """Stop listening: a sequence not finished yet is aborted, which frees its blocks."""
        if not self.done:
            self.done = True
            self._abort(self.request_id)


class FinishedStream(OutputStream):
    """The outputs of a request whose replayed tokens already end it (the worker that sampled the
    last of them died before it could say so): the text it held back, if any, and the end."""

    def __init__(self, seq: EngineSequence):
        q: asyncio.Queue[SeqOutput] = asyncio.Queue()
        q.put_nowait(SeqOutput(seq.request_id, text=final_text(seq), finished=True,
                               finish_reason=seq.finish_reason))
        super().__init__(seq, q, lambda rid: None)
