"""Runs the engine's steps on a dedicated thread so a forward pass never blocks the event loop.

Sequences deliver their outputs to asyncio queues through call_soon_threadsafe; the HTTP side only
ever awaits those queues. The thread beats at every turn of its loop (a step, or a wait of at most
a second); `health()` reports a thread that died or stopped beating for `stall_s`, which the
worker turns into a failing /health so the liveness probe restarts the pod. An error escaping a
step (a bug: the step keeps a sequence's own failures to it) is logged and the loop goes on after
a pause; nothing fails every sequence at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from tandem.worker.engine.engine import Engine
from tandem.worker.engine.sequence import SeqOutput, Sequence

log = logging.getLogger("tandem.worker.engine")

T = TypeVar("T")
DEFAULT_STALL_S = 120.0  # longer than any one step a worker should ever take (a prefill chunk)


class AsyncEngine:
    def __init__(self, engine: Engine, stall_s: float = DEFAULT_STALL_S):
        self.engine = engine
        self.stall_s = stall_s
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: list[tuple[asyncio.Queue[SeqOutput], SeqOutput]] = []
        self._pending_lock = threading.Lock()
        self._flush_scheduled = False
        self._beat = time.monotonic()  # the loop's last turn
        self._last_error: str | None = None
        self._changed: asyncio.Event | None = None  # set (and replaced) after outputs or freed blocks
        # Seconds from one step's end to the next one's start while there was work: what the loop,
        # its locks and the GIL (the HTTP thread's turn) cost the model's cadence.
        self.on_step_gap: Callable[[float], None] = lambda seconds: None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        self.engine.on_blocks_freed = self._blocks_freed
        self._beat = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    def health(self) -> str | None:
        """None while the engine thread is alive and turning; else what is wrong with it."""
        if self._thread is None or self._stopping:
            return None
        if not self._thread.is_alive():
            return "the engine thread has died"
        if (problem := self.engine.runner.problem()) is not None:
            return problem
        stalled = time.monotonic() - self._beat
        if stalled > self.stall_s:
            why = f" (last error: {self._last_error})" if self._last_error else ""
            return f"the engine thread has made no progress for {stalled:.0f} s{why}"
        return None

    def _run(self) -> None:
        eng = self.engine
        backoff = 0.0
        last_step_end: float | None = None
        while not self._stopping:
            try:
                self._wake.clear()
                eng.expire_leases()
                if eng.has_work():
                    start = time.perf_counter()
                    if eng.step():
                        if last_step_end is not None:
                            self.on_step_gap(start - last_step_end)
                        last_step_end = time.perf_counter()
                        self._beat, backoff = time.monotonic(), 0.0
                        continue
                last_step_end = None
                self._beat = time.monotonic()
                # Idle, or every waiting sequence needs blocks that leases hold: sleep until
                # something changes (a request, an abort, freed blocks) or the next lease expires.
                nxt = eng.next_lease_expiry()
                self._wake.wait(1.0 if nxt is None else max(0.0, min(1.0, nxt - time.monotonic())))
                self._beat = time.monotonic()
            except Exception as e:  # noqa: BLE001 - the loop must survive any one bad turn
                log.exception("engine loop error; the sequences stay queued and the loop goes on")
                self._last_error = f"{type(e).__name__}: {e}"
                backoff = min(1.0, max(0.05, 2 * backoff))
                self._wake.wait(backoff)

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
        self._signal_change()

    def _blocks_freed(self) -> None:
        self._wake.set()
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._signal_change)

    def _signal_change(self) -> None:
        if self._changed is not None:
            changed, self._changed = self._changed, asyncio.Event()
            changed.set()

    async def wait_for(self, attempt: Callable[[], T | None], timeout_s: float) -> T | None:
        """attempt() until it returns something other than None, trying again whenever a step has
        delivered outputs or blocks were freed, for timeout_s at most; None if it never did."""
        deadline = time.monotonic() + timeout_s
        while True:
            changed = self._changed  # taken before the attempt: a change during it is not missed
            result = attempt()
            remaining = deadline - time.monotonic()
            if result is not None or remaining <= 0 or changed is None:
                return result
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), remaining)

    def submit(self, seq: Sequence, *, kv_blocks: list[int] | None = None) -> OutputStream:
        """Add a sequence now (raising RequestError at once, e.g. for a duplicate id or a full queue)
        and return its outputs until it finishes (or, for prefill_only, until its blocks are
        leased). With kv_blocks the prompt's KV is already in the pool (the prefill's first token
        is in seq.output_ids). A caller that stops listening early must close() the stream."""
        q = self._attach(seq)
        if kv_blocks is not None:
            self.engine.add_prefilled(seq, kv_blocks)
        else:
            self.engine.add(seq)
        self._wake.set()
        return OutputStream(self, seq.request_id, q)

    def abort(self, request_id: str, lease_token: str | None = None) -> bool:
        found = self.engine.abort(request_id, lease_token)
        self._wake.set()
        return found

    def start_migration(self) -> None:
        """Hand every sequence out at the start of the next step (Engine.start_migration)."""
        self.engine.start_migration()
        self._wake.set()


class OutputStream:
    """One sequence's outputs as the engine delivers them, read in batches: whatever arrived while
    the reader was busy comes at once (one write for a stream that lags), and a wait for the next
    one has a timeout without a task of its own (the reader sends heartbeats meanwhile)."""

    def __init__(self, engine: AsyncEngine, request_id: str, q: asyncio.Queue[SeqOutput]):
        self._engine = engine
        self.request_id = request_id
        self._q = q
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
            self._engine.abort(self.request_id)
