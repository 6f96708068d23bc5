"""The engine: a model, one paged KV pool, a scheduler, and the step that ties them together.

`Engine` is synchronous and holds every request from its claim to its end, guarded by one lock. The
request table (request_table.py) holds them and is the one writer of their states, along the moves
request_state.py allows; the engine owns the rest through objects that own theirs: admission control
(admission.py: unique ids, the bounded queue), the scheduler (who runs each step), the prefix cache
over the block allocator. `AsyncEngine` (async_engine.py) runs its steps on a
dedicated thread and drives the stages that wait (tokenizing, the KV pull) for the HTTP server;
tests and benchmarks drive `Engine` directly. The model is reached through one interface, the
runner (model_runner.py `build_runner`: `forward(items) -> StepLogits`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection

import torch
from tandem.contracts import timing
from tandem.contracts.protocol import FinishReason, GenerateRequest
from tandem.worker.engine.admission import AdmissionControl
from tandem.worker.engine.batch import run_batch
from tandem.worker.engine.block_allocator import BlockAllocator
from tandem.worker.engine.chunk_sizing import sizer_for
from tandem.worker.engine.config import EngineConfig
from tandem.worker.engine.engine_lock import PublishingLock
from tandem.worker.engine.engine_stats import EngineStats
from tandem.worker.engine.intake import Intake
from tandem.worker.engine.leases import LeaseTable
from tandem.worker.engine.loader import LoadedModel, load_model
from tandem.worker.engine.migration import hand_out
from tandem.worker.engine.model_runner import build_runner
from tandem.worker.engine.output_processor import Sampled, final_text, take_output
from tandem.worker.engine.pool_sizing import size_pool
from tandem.worker.engine.prefix_cache import PrefixCache, PullReservation, prefix_salt
from tandem.worker.engine.request_state import RequestState
from tandem.worker.engine.request_table import RequestTable
from tandem.worker.engine.scheduler import ScheduledChunk, Scheduler
from tandem.worker.engine.sequence import EngineSequence, SeqOutput

log = logging.getLogger("tandem.worker.engine")

KVEventCallback = Callable[[list[bytes], list[bytes]], None]


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, lease_s: float = timing.KV_LEASE_S, *,
                 on_step: Callable[[float, int], None] = lambda seconds, num_tokens: None):
        """`on_step(seconds, tokens)` after every step that ran, before its outputs go out."""
        config.check()
        if config.threads:
            torch.set_num_threads(config.threads)
        self.config = config
        self.loaded = lm = loaded or load_model(
            config.model, dtype=config.dtype, device=config.device, max_model_len=config.max_model_len,
            trust_remote_code=config.trust_remote_code, backend=config.model_backend,
        )
        self.tokenizer = lm.tokenizer
        self.vocab_size = int(lm.config.vocab_size)
        self.served_name = config.served_name or lm.name
        self.layout, self.max_model_len = size_pool(config, lm)
        self.intake = Intake(lm.tokenizer, self.vocab_size, self.max_model_len, lm.eos_ids)
        # One contiguous tensor for the whole pool, allocated once: transports register it once.
        self.pool = torch.zeros(self.layout.shape, dtype=lm.dtype, device=lm.device)
        log.info("KV pool: %d blocks of %d tokens, %.1f MiB", self.layout.num_blocks, config.block_size,
                 self.pool.numel() * self.pool.element_size() / 2**20)
        self.allocator = BlockAllocator(self.layout.num_blocks)
        self.prefix_hash_salt = prefix_salt(self.layout, str(lm.config.model_type), self.vocab_size)
        self.prefix_cache = PrefixCache(self.allocator, config.block_size, self.prefix_hash_salt,
                                        enabled=config.prefix_caching)
        # Every request here and its state (claims, held sequences, leases): its one writer.
        self.requests = RequestTable(lease_s)
        self.scheduler = Scheduler(
            self.allocator, config.block_size, config.max_num_seqs, config.max_batched_tokens,
            on_preempt=self._on_preempt, prefill_chunk_tokens=config.prefill_chunk_tokens,
            prefix_cache=self.prefix_cache, requests=self.requests, flow_chunk_tokens=config.flow_chunk_tokens,
        )
        self.chunk_sizer = sizer_for(self.scheduler, config.prefill_stall_factor, config.block_size)
        self.runner, why = build_runner(lm, self.pool, self.layout, config.compile, self.max_model_len)
        log.info("engine: %s on %s, %d thread(s); decode step: %s; prefill up to %d prompt tokens per step; "
                 "prefix caching %s", str(lm.dtype).removeprefix("torch."), lm.device, torch.get_num_threads(),
                 why, self.scheduler.prefill_chunk_tokens, "on" if config.prefix_caching else "off")
        # Guards every request and block; publishes the prefix cache's changes as it is let go.
        self.lock = PublishingLock(self.prefix_cache.publish)
        max_waiting = config.max_waiting if config.max_waiting is not None else 2 * config.max_num_seqs
        self.admission = AdmissionControl(
            config.max_num_seqs, max_waiting, in_use=self.requests.holds,
            load=lambda: (len(self.scheduler.running), self.scheduler.num_queued), claims=self.requests.claims)
        self.stats = EngineStats()
        self.on_step = on_step
        self._migrating = False  # draining: every sequence leaves at the start of the next step

    @property
    def seqs(self) -> dict[str, EngineSequence]:
        """PULLING, WAITING, RUNNING or ABORTING, by request id (the request table's; read only)."""
        return self.requests.seqs

    @property
    def leases(self) -> LeaseTable:
        """LEASED and MIGRATING (the request table's; read only)."""
        return self.requests.leases

    # ---- requests in: claimed, then WAITING or PULLING (request_state.py) ----------------------

    def make_sequence(self, req: GenerateRequest, *, prefill_only: bool = False) -> EngineSequence:
        """Tokenize and validate a request (intake.py); RequestError (a 4xx) for anything wrong. One
        that the tokens it generated elsewhere already end is made FINISHED_STOPPED or _LENGTH."""
        seq, ended = self.intake.sequence(req, prefill_only=prefill_only)
        if ended is not None:
            with self.lock:
                self.requests.move(seq, RequestState.finished(ended))
        return seq

    def claim(self, request_id: str) -> None:
        """Hold an id and a queue place before any work for a request (admission.py): RequestError
        409 for an id in use here, 429 when the queue is full; add or finish_pull (or unclaim) ends it."""
        with self.lock:
            self.admission.claim(request_id)

    def unclaim(self, request_id: str) -> None:
        """Let go of a claim that never became a sequence; a no-op once add or finish_pull took it."""
        with self.lock:
            self.admission.unclaim(request_id)

    def add(self, seq: EngineSequence) -> None:
        """WAITING: queue a sequence to be prefilled here and decoded; its claim (if any) ends here
        (unclaimed, it is admitted now: 409 or 429 as claim)."""
        with self.lock:
            self.admission.take(seq.request_id)
            self.stats.prompt_tokens_total += len(seq.prompt_ids)
            self.scheduler.add(seq)

    def begin_pull(self, seq: EngineSequence) -> PullReservation | None:
        """PULLING (its claim still held): blocks for the KV of all but its last token (the leading
        ones this pool caches, then fresh ones, prefix_cache.py), held by the sequence; None when the
        pool is too full right now. Under the lock, so a step never finds fewer free blocks than it
        just counted, and leaving a block per running sequence for its next token."""
        with self.lock:
            res = self.prefix_cache.reserve(seq, spare=len(self.scheduler.running))
            if res is not None:
                self.requests.move(seq, RequestState.PULLING)
            return res

    def finish_pull(self, seq: EngineSequence) -> None:
        """PULLING -> WAITING: its KV is in its blocks; it waits for a seat, and its last generated
        token is the next one to run. Its claim ends here. One aborted meanwhile ends now."""
        with self.lock:
            self.admission.take(seq.request_id)
            if seq.status is not RequestState.ABORTING:
                seq.num_computed = seq.num_tokens - 1
                self.prefix_cache.commit(seq)
                self.stats.prompt_tokens_total += len(seq.prompt_ids)
                self.scheduler.add_ready(seq)
                return
            out = self._aborted(seq)
        seq.emit(out)

    def fail_pull(self, seq: EngineSequence, *, keep_blocks: bool = False, requeue: bool = False) -> list[int]:
        """PULLING -> FINISHED: the pull failed or was cancelled; its blocks go back to the pool, or,
        with keep_blocks (a READ may still land in them), to the caller, who frees them once it has
        stopped (free_landed). Its claim stays with the caller (unclaim). With requeue (its KV failed
        verification) it goes to WAITING instead, to be prefilled here, unless aborted meanwhile."""
        with self.lock:
            aborted = seq.status is RequestState.ABORTING
            kept = list(seq.block_table) if keep_blocks else []
            if keep_blocks:
                seq.block_table = []
            self.prefix_cache.release(seq)
            if requeue and not aborted:
                self.add(seq)  # PULLING -> WAITING; its claim ends here
            else:
                self.requests.move(seq, RequestState.FINISHED_ABORTED if aborted else RequestState.FINISHED_ERROR)
            return kept

    def free_landed(self, block_ids: list[int]) -> None:
        """Blocks fail_pull kept while a READ could still write into them: that READ has stopped."""
        with self.lock:
            self.allocator.free(block_ids)

    # ---- ending things (request_state.py: one verb per meaning) ---------------------------------

    def abort(self, request_id: str, lease_token: str | None = None) -> bool:
        """Cancel a request in any state and free what it holds here; its KV lease only when
        lease_token proves it (the lease's token went only to the decode worker and router). One
        inside a step's forward pass, or being pulled, ends when that step or pull does."""
        found = lease_token is not None and self._end_lease(request_id, lease_token, aborted=True)
        with self.lock:
            seq = self.seqs.get(request_id)
            if seq is None:
                return found
            if seq.status is RequestState.ABORTING:
                return True
            if seq.status is RequestState.PULLING or request_id in self.requests.in_flight:
                self.requests.move(seq, RequestState.ABORTING)  # ends with its pull or its step
                return True
            out = self._aborted(seq)
        seq.emit(out)
        return True

    def withdraw(self, request_id: str) -> bool:
        """Take back a request that has not started (its caller will not wait longer); False when
        it runs already or is gone."""
        with self.lock:
            seq = self.seqs.get(request_id)
            if seq is None or request_id in self.requests.in_flight or not self.scheduler.withdraw(seq):
                return False
            self.requests.move(seq, RequestState.FINISHED_WITHDRAWN)
            return True

    def release_lease(self, request_id: str, lease_token: str) -> bool:
        """LeaseKeeper (worker/kv/base.py): a peer is done with a lease whose token it quoted
        (pulled, released or given up); False, freeing nothing, for a wrong token or a lease gone."""
        return self._end_lease(request_id, lease_token)

    def expire_leases(self, now: float | None = None) -> list[str]:
        """End the leases nobody pulled in time; their request ids."""
        with self.lock:
            expired = self.leases.expired(now)
            for rid in expired:
                log.warning("KV lease expired before a peer pulled it", extra={"request_id": rid})
                self._end_lease(rid, None)
        return expired

    def _end_lease(self, request_id: str, lease_token: str | None, *, aborted: bool = False) -> bool:
        with self.lock:
            lease = self.requests.end_lease(request_id, lease_token, aborted=aborted)
            if lease is not None:
                self.scheduler.free_blocks(lease.seq)
            return lease is not None

    def _aborted(self, seq: EngineSequence) -> SeqOutput:
        """Under the lock: seq ends (WAITING, RUNNING, or ABORTING once its step or pull is over)."""
        self._finish(seq, FinishReason.ABORT)
        return SeqOutput(seq.request_id, text=final_text(seq), finished=True, finish_reason=FinishReason.ABORT)

    # ---- leases, as the KV transports ask about them --------------------------------------------

    def check_read(self, request_id: str, lease_token: str, block_ids: Collection[int]) -> bool:
        """LeaseKeeper: a live lease of request_id, proven by its token, holds every one of them."""
        with self.lock:
            return self.leases.may_read(request_id, lease_token, block_ids)

    def lease_token(self, request_id: str) -> str | None:
        """The token of request_id's live lease, to hand out with the KVSource naming its blocks."""
        with self.lock:
            return self.leases.token(request_id)

    def next_lease_expiry(self) -> float | None:
        with self.lock:
            return self.leases.next_expiry()

    # ---- the step ---------------------------------------------------------------------------

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> int:
        """Run one forward pass over the scheduled batch; returns the number of tokens processed.
        A failure caused by one sequence ends that sequence alone (batch.py). A draining engine
        first hands its sequences out (start_migration)."""
        if self._migrating:
            self._hand_out()
        t0 = time.perf_counter()
        with self.lock:
            chunks = self.scheduler.schedule()
            if not chunks:
                return 0
            items = [c.batch_item() for c in chunks]
            self.requests.in_flight = frozenset(c.seq.request_id for c in chunks)
            prefill_tokens = sum(c.num_tokens for c in chunks if c.prefill)
        results = run_batch(self.runner, chunks, items)
        emits: list[tuple[EngineSequence, SeqOutput]] = []
        with self.lock:
            self.requests.in_flight = frozenset()
            for c, result in zip(chunks, results, strict=True):
                out = self._advance(c, result)
                if out is not None:
                    emits.append((c.seq, out))
            self.stats.steps_total += 1
            self.stats.prefill_tokens_computed_total += prefill_tokens
        n = sum(c.num_tokens for c in chunks)
        seconds = time.perf_counter() - t0
        if self.chunk_sizer is not None:
            self.chunk_sizer.observe(seconds, n - prefill_tokens, prefill_tokens)
        self.on_step(seconds, n)  # before the outputs: a reader sees its own step
        for seq, out in emits:
            seq.emit(out)
        return n

    def _advance(self, c: ScheduledChunk, result: Sampled | None | Exception) -> SeqOutput | None:
        """Under the lock: what one chunk's result does to its sequence; its output, if any."""
        seq = c.seq
        if seq.finished:
            return None
        if seq.status is RequestState.ABORTING:  # aborted inside this step: never leased, never continued
            return self._aborted(seq)
        if isinstance(result, Exception):
            self._finish(seq, FinishReason.ERROR)
            return SeqOutput.engine_error(seq.request_id, result)
        seq.num_computed += c.num_tokens
        self.prefix_cache.commit(seq)
        if result is None:
            return None
        try:
            return self._append_token(seq, result)
        except Exception as e:  # noqa: BLE001 - detokenizing or a stop check failed for this sequence
            log.exception("failed to take a token", extra={"request_id": seq.request_id})
            if not seq.finished:
                self._finish(seq, FinishReason.ERROR)
            return SeqOutput.engine_error(seq.request_id, e)

    def _append_token(self, seq: EngineSequence, sampled: Sampled) -> SeqOutput:
        """A sampled token through the output processor; RUNNING -> FINISHED, or LEASED for a prefill."""
        out, reason = take_output(seq, sampled)
        self.stats.generation_tokens_total += 1
        if reason is not None:
            self._finish(seq, reason)
        elif seq.prefill_only:
            self.scheduler.take_out(seq)
            self.requests.lease(seq, RequestState.LEASED)
            out.kv_blocks = list(seq.block_table)
        return out

    def _finish(self, seq: EngineSequence, reason: FinishReason) -> None:
        self.stats.requests_finished[reason.value] = self.stats.requests_finished.get(reason.value, 0) + 1
        self.requests.move(seq, RequestState.finished(reason))
        self.scheduler.remove(seq)

    def _on_preempt(self, seq: EngineSequence) -> None:
        self.stats.preemptions_total += 1
        log.info("preempted (will recompute)", extra={"request_id": seq.request_id})

    # ---- migration (migration.py): a draining engine hands its sequences out -------------------

    def start_migration(self) -> None:
        """From now on every sequence (but a prefill's) leaves at the start of the next step, never
        while a step is in flight: MIGRATING with its KV leased when it has some worth moving,
        else FINISHED (the router recomputes it elsewhere). Their outputs say `migrated`."""
        with self.lock:
            self._migrating = True

    def _hand_out(self) -> None:
        with self.lock:
            emits = hand_out(self.requests, self.scheduler, self.layout, self.stats.migrated_out)
        for seq, out in emits:
            seq.emit(out)

    # ---- the prefix cache as the KV event stream sees it (worker/server/kv_events.py) -----------

    def follow_kv_events(self, on_snapshot: Callable[[int, bytes, list[bytes]], None],
                         on_change: KVEventCallback) -> bool:
        """The prefix cache's changes, as worker/server/kv_events.py follows them (PrefixCache.follow,
        under this engine's lock); False, following nothing, without a prefix cache."""
        with self.lock:
            return self.prefix_cache.follow(on_snapshot, on_change)

    def cached_block_hashes(self) -> list[bytes]:
        """Every block hash this engine caches, as its KV events have told so far."""
        with self.lock:
            return self.allocator.cached_hashes()

    # ---- views ---------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Queued for a seat: prompts, pulled handoffs, and handoffs being pulled."""
        return self.scheduler.num_queued + self.admission.num_claims

    @property
    def max_waiting(self) -> int:
        return self.admission.max_waiting

    def idle(self) -> bool:
        """Nothing here that a drain waits for: no sequence, no lease, no claimed request."""
        with self.lock:
            return not self.requests

    def outstanding_prompt_tokens(self) -> int:
        with self.lock:
            seqs = list(self.scheduler.waiting) + self.scheduler.running
            return sum(s.num_pending for s in seqs if not s.decoding)
