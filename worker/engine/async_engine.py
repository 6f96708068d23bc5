"""The engine as the event loop sees it: a request taken from admission to its end (request_state.py),
the steps run on a dedicated thread so a forward pass never blocks the loop.

`generate` and `prefill` are the two ways in: each claims the request's id, tokenizes it, pulls a
handoff's KV (kv_pull.py) or queues it, and hands back its outputs; whatever fails on the way
leaves nothing held, so the HTTP layer only parses and streams. Sequences deliver their outputs to
asyncio queues through call_soon_threadsafe; the HTTP side only ever awaits those queues.

The thread beats at every turn of its loop (a step, or a wait of at most a second); `health()`
reports a thread that died or stopped beating for `stall_s`, which the worker turns into a failing
/health so the liveness probe restarts the pod. An error escaping a step (a bug: the step keeps a
sequence's own failures to it) is logged and the loop goes on after a pause; nothing fails every
sequence at once. This object is also the KV transport's LeaseKeeper (worker/kv/base.py): a lease
a peer releases wakes the step loop and any handoff waiting for blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TypeVar

from tandem.contracts import timing
from tandem.contracts.kv_source import KVSource
from tandem.contracts.protocol import GenerateRequest
from tandem.worker.engine import kv_pull
from tandem.worker.engine.engine import Engine
from tandem.worker.engine.errors import RequestError
from tandem.worker.engine.kv_pull import Digests, KVEndpoint, PullReport
from tandem.worker.engine.output_stream import FinishedStream, OutputStream
from tandem.worker.engine.sequence import EngineSequence, SeqOutput

log = logging.getLogger("tandem.worker.engine")

T = TypeVar("T")
DEFAULT_STALL_S = 120.0  # longer than any one step a worker should ever take (a prefill chunk)
_PREFILL_POLL_S = 1.0  # how often a waiting prefill looks at its queue deadline and the engine's health


@dataclass
class PrefillOutput:
    """A prefill's one output: its first token, and where a peer finds its leased KV (None when the
    first token already ended it, or when `out.error` says the engine failed on it)."""

    seq: EngineSequence
    out: SeqOutput
    kv: KVSource | None


class AsyncEngine:
    def __init__(self, engine: Engine, stall_s: float = DEFAULT_STALL_S, *,
                 on_step_gap: Callable[[float], None] = lambda seconds: None,
                 on_pulled: Callable[[PullReport], None] = lambda report: None):
        self.engine = engine
        self.stall_s = stall_s
        # Seconds from one step's end to the next one's start while there was work: what the loop,
        # its locks and the GIL (the HTTP thread's turn) cost the model's cadence.
        self.on_step_gap = on_step_gap
        self.on_pulled = on_pulled
        self.kv: KVEndpoint | None = None  # set by start(): this worker as a KV peer
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

    def start(self, kv: KVEndpoint | None = None) -> None:
        """Start the step thread; `kv`: this worker's KV transport and identity, for handoffs."""
        self.kv = kv
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
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

    # ---- requests in --------------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> OutputStream:
        """Admit a request to decode here: claimed, tokenized, its handoff KV pulled (PULLING) or
        its prompt queued (WAITING); its outputs until it ends. RequestError for a refusal, with
        nothing left held. A caller that stops listening early must close() the stream."""
        eng, rid = self.engine, req.request_id
        eng.claim(rid)
        try:
            seq = await self._sequence(req)
            if seq.finished:  # the worker that sampled the last of them died before it could say so
                return FinishedStream(seq)
            stream = self._attach(seq)
            if req.kv_source is None:
                eng.add(seq)
            else:
                try:
                    report = await kv_pull.pull(eng, self.kv, req, seq, self.wait_for, self._blocks_freed)
                finally:
                    self._blocks_freed()  # a failed pull gave its blocks back; a good one queued a sequence
                self.on_pulled(report)
            self._wake.set()
            return stream
        finally:
            eng.unclaim(rid)  # a no-op once the sequence took its claim over

    async def prefill(self, req: GenerateRequest, queue_s: float) -> PrefillOutput:
        """Take a prompt through WAITING and RUNNING to LEASED: its first token and its KV's
        source. RequestError 429 when it has not started after `queue_s` (it is withdrawn), 503
        when the engine stops making progress or the lease ended before it was handed out; a
        prefill that fails or is cancelled on the way leaves no lease behind."""
        eng, rid = self.engine, req.request_id
        eng.claim(rid)
        try:
            if self.kv is None:  # nobody could pull the blocks: a lease would only hold memory
                raise RequestError("this worker has no KV transport (--kv-backend none), so it cannot act "
                                   "as a prefill peer", code="kv_backend_mismatch")
            seq = await self._sequence(req, prefill_only=True)
            if seq.finished:  # its generated tokens already end it: no first token left to compute
                raise RequestError(f"the tokens this request carries already end it (finish_reason "
                                   f"{seq.finish_reason}): there is nothing to prefill", param="generated_token_ids",
                                   code="request_already_finished")
            stream = self._attach(seq)
            eng.add(seq)
            self._wake.set()
        finally:
            eng.unclaim(rid)
        handed_out = False
        try:
            out = await self._first_output(stream, rid, queue_s)
            kv = None
            if out.kv_blocks is not None and out.error is None:
                # The blocks' digests off the loop (worker/kv/verify.py): the lease keeps them as they are.
                digests = await self.kv.digests(out.kv_blocks)
                kv = self.lease_source(rid, out.kv_blocks, seq.num_computed, digests)
                if kv is None:
                    raise RequestError("the KV lease ended before the prefill result was sent (lease_s too "
                                       "short?): retry", status=503, type_="service_unavailable",
                                       code="kv_lease_expired")
            handed_out = True
            return PrefillOutput(seq, out, kv)
        finally:
            if not handed_out:
                stream.close()
                token = eng.lease_token(rid)  # leased perhaps, but its token was never handed out
                if token is not None:
                    self.abort(rid, token)

    async def _first_output(self, stream: OutputStream, rid: str, queue_s: float) -> SeqOutput:
        deadline = time.monotonic() + queue_s
        while True:
            outs = await stream.get(max(0.01, min(_PREFILL_POLL_S, deadline - time.monotonic())))
            if outs:
                return outs[0]
            if (problem := self.health()) is not None:
                raise RequestError(problem, status=503, type_="service_unavailable", code="engine_unhealthy")
            if time.monotonic() >= deadline and self.engine.withdraw(rid):
                raise RequestError(f"the prompt waited {queue_s:g} s in this prefill worker's queue without "
                                   "starting", status=429, type_="service_unavailable",
                                   code="prefill_queue_timeout", retry_after_s=timing.WORKER_RETRY_AFTER_S)

    async def _sequence(self, req: GenerateRequest, prefill_only: bool = False) -> EngineSequence:
        """engine.make_sequence, on a thread when it tokenizes text or messages or builds a grammar (the
        event loop serves every other stream meanwhile); inline for token ids, which cost nothing."""
        if req.prompt_token_ids is not None and req.sampling.structured is None:
            return self.engine.make_sequence(req, prefill_only=prefill_only)
        return await asyncio.to_thread(self.engine.make_sequence, req, prefill_only=prefill_only)

    def lease_source(self, request_id: str, block_ids: list[int], num_tokens: int,
                     digests: Digests) -> KVSource | None:
        """Where a peer finds the KV of `num_tokens` tokens leased here in `block_ids`, with the
        lease's token and the blocks' `digests` (KVEndpoint.digests); None when the lease has ended
        already (or this worker has no transport)."""
        token = self.engine.lease_token(request_id)
        if token is None or self.kv is None:
            return None
        return self.kv.source(request_id, block_ids, num_tokens, token, digests)

    # ---- ending things, and the transport's LeaseKeeper ----------------------------------------

    def abort(self, request_id: str, lease_token: str | None = None) -> bool:
        found = self.engine.abort(request_id, lease_token)
        self._blocks_freed()
        return found

    def release_lease(self, request_id: str, lease_token: str) -> bool:
        """LeaseKeeper: a peer is done with a lease (pulled, or given up)."""
        found = self.engine.release_lease(request_id, lease_token)
        if found:
            self._blocks_freed()
        return found

    def check_read(self, request_id: str, lease_token: str, block_ids: Collection[int]) -> bool:
        """LeaseKeeper: whether a peer may read these blocks (Engine.check_read)."""
        return self.engine.check_read(request_id, lease_token, block_ids)

    def start_migration(self) -> None:
        """Hand every sequence out at the start of the next step (Engine.start_migration)."""
        self.engine.start_migration()
        self._wake.set()

    # ---- the step thread, and outputs back to the loop ------------------------------------------

    def _run(self) -> None:
        eng = self.engine
        backoff = 0.0
        last_step_end: float | None = None
        while not self._stopping:
            try:
                self._wake.clear()
                if eng.expire_leases():
                    self._blocks_freed()
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

    def _attach(self, seq: EngineSequence) -> OutputStream:
        q: asyncio.Queue[SeqOutput] = asyncio.Queue()
        assert self._loop is not None, "AsyncEngine.start() first"
        seq.sink = lambda out: self._deliver(q, out)
        return OutputStream(seq, q, self.abort)

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
        """Blocks came back outside a step: wake the step loop and whoever waits for blocks."""
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
