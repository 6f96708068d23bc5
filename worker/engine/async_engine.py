"""Runs the engine's steps on a dedicated thread so a forward pass never blocks the event loop.

Sequences deliver their outputs to asyncio queues through call_soon_threadsafe; the HTTP side only
ever awaits those queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator

from tandem.worker.engine.engine import Engine
from tandem.worker.engine.sequence import SeqOutput, Sequence

log = logging.getLogger("tandem.worker.engine")


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: list[tuple[asyncio.Queue[SeqOutput], SeqOutput]] = []
        self._pending_lock = threading.Lock()
        self._flush_scheduled = False

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.engine.on_blocks_freed = self._wake.set
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    def _run(self) -> None:
        eng = self.engine
        while not self._stopping:
            try:
                self._wake.clear()
                eng.expire_leases()
                if eng.has_work() and eng.step():
                    continue
                # Idle, or every waiting sequence needs blocks that leases hold: sleep until
                # something changes (a request, an abort, freed blocks) or the next lease expires.
                nxt = eng.next_lease_expiry()
                self._wake.wait(1.0 if nxt is None else max(0.0, min(1.0, nxt - time.monotonic())))
            except Exception as e:  # noqa: BLE001 - the loop must survive any one bad step
                log.exception("engine loop error; failing the sequences in flight")
                eng.fail_all(e)
                time.sleep(0.1)

    def _attach(self, seq: Sequence) -> asyncio.Queue[SeqOutput]:
        q: asyncio.Queue[SeqOutput] = asyncio.Queue()
        assert self._loop is not None, "AsyncEngine.start() first"
        seq.sink = lambda out: self._deliver(q, out)
        return q

    def _deliver(self, q: asyncio.Queue[SeqOutput], out: SeqOutput) -> None:
        """Hand an output to the event loop. A step's outputs (one per running sequence) share
        one wake-up of the loop: waking it costs a syscall, 32 per step were 4-7% of the engine."""
        with self._pending_lock:
            self._pending.append((q, out))
            if self._flush_scheduled:
                return
            self._flush_scheduled = True
        with contextlib.suppress(RuntimeError):  # the loop is closing: nobody is listening
            self._loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._pending_lock:
            pending, self._pending = self._pending, []
            self._flush_scheduled = False
        for q, out in pending:
            q.put_nowait(out)

    def submit(self, seq: Sequence, *, kv_blocks: list[int] | None = None) -> AsyncIterator[SeqOutput]:
        """Add a sequence now (raising RequestError at once, e.g. for a duplicate id) and return its
        outputs until it finishes (or, for prefill_only, until its blocks are leased). With kv_blocks
        the prompt's KV is already in the pool (the prefill's first token is in seq.output_ids).
        A caller that stops listening early must call abort(request_id)."""
        q = self._attach(seq)
        if kv_blocks is not None:
            self.engine.add_prefilled(seq, kv_blocks)
        else:
            self.engine.add(seq)
        self._wake.set()
        return self._outputs(seq, q)

    async def _outputs(self, seq: Sequence, q: asyncio.Queue[SeqOutput]) -> AsyncIterator[SeqOutput]:
        done = False
        try:
            while True:
                out = await q.get()
                done = out.finished or out.kv_blocks is not None
                yield out
                if done:
                    return
        finally:
            if not done:
                self.abort(seq.request_id)

    def abort(self, request_id: str, lease_token: str | None = None) -> bool:
        found = self.engine.abort(request_id, lease_token)
        self._wake.set()
        return found
