"""Admission (mixed into `Engine`): unique request ids across running, queued, leased and
being-pulled requests; a queue bounded beyond the free seats (429 with a retry hint); claims that
hold an id and a queue place before any work; reservations for a pull, made under the engine's
lock; pulled sequences queued for a seat; withdrawal of a request that has not started.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.contracts.kv_layout import KVLayout
from tandem.worker.engine.block_allocator import BlockAllocator
from tandem.worker.engine.errors import RequestError
from tandem.worker.engine.prefix_cache import PrefixCache, PublishingLock
from tandem.worker.engine.request_state import RequestState
from tandem.worker.engine.scheduler import Scheduler
from tandem.worker.engine.sequence import SeqOutput, Sequence


@dataclass
class PullReservation:
    """Blocks held for a pulled prompt: `cached` already hold its leading blocks, `fresh` receive
    the rest from the prefill worker."""

    cached: list[int]
    fresh: list[int]

    @property
    def blocks(self) -> list[int]:
        return self.cached + self.fresh


class Admission:
    """The admission half of the engine (attributes set by Engine.__init__)."""

    lock: PublishingLock
    seqs: dict[str, Sequence]
    leases: dict[str, Any]
    scheduler: Scheduler
    allocator: BlockAllocator
    prefix_cache: PrefixCache
    layout: KVLayout
    config: Any
    stats: Any
    max_waiting: int
    _claims: set[str]
    _in_flight: set[str]
    _abort_after_pull: set[str]
    _aborted: Callable[[Sequence], SeqOutput]
    _emit: Callable[[Sequence, SeqOutput], None]

    def add(self, seq: Sequence) -> None:
        """Queue a sequence to be prefilled (locally) and decoded. RequestError 409 for an id in
        use here, 429 (retry later) when the queue is full; its claim (if any) ends here."""
        with self.lock:
            self._take_claim(seq.request_id)
            self.seqs[seq.request_id] = seq
            self.stats.prompt_tokens_total += len(seq.prompt_ids)
            self.scheduler.add(seq)

    def claim(self, request_id: str) -> None:
        """Take a place in the queue before any work for a request (tokenizing, a KV pull), so a
        duplicate id or a full queue is refused first; add or finish_pull (or unclaim) ends it."""
        with self.lock:
            self._admit(request_id)
            self._claims.add(request_id)

    def unclaim(self, request_id: str) -> None:
        """Let go of a claim that never became a sequence (its request failed before it was queued);
        a no-op once add or finish_pull took it over."""
        with self.lock:
            self._claims.discard(request_id)

    def _take_claim(self, request_id: str) -> None:
        """Under the lock: the request's claim ends, or (unclaimed) it is admitted now."""
        if request_id in self._claims:
            self._claims.discard(request_id)
        else:
            self._admit(request_id)

    def _admit(self, request_id: str) -> None:
        """Under the lock: refuse an id that is running, queued, leased or being pulled here, or
        any request while the queue is full."""
        if request_id in self.seqs or request_id in self.leases or request_id in self._claims:
            raise RequestError(f"request {request_id!r} is already running here",
                               status=409, param="request_id", code="duplicate_request_id")
        queued = self.scheduler.num_queued + len(self._claims)
        free_seats = max(0, self.config.max_num_seqs - len(self.scheduler.running))
        if queued >= free_seats + self.max_waiting:
            raise RequestError(f"this worker is full: {len(self.scheduler.running)} sequences run and "
                               f"{queued} wait (at most {self.max_waiting}): retry shortly or elsewhere",
                               status=429, type_="service_unavailable", code="queue_full", retry_after_s=1.0)

    def begin_pull(self, seq: Sequence) -> PullReservation | None:
        """PULLING (its claim still held): blocks for the KV of all but the last token (a handoff:
        the prompt; a migration: prompt and generated tokens): the leading blocks this pool already
        caches (at least the last block is still pulled: the pull also ends the peer's lease), then
        new blocks for the rest, held by the sequence; None when the pool is too full right now.
        Under the engine's lock (so a step never finds fewer free blocks than it just counted), and
        leaving a block per running sequence for their next tokens."""
        n = seq.num_tokens - 1
        with self.lock:
            hit = self.prefix_cache.match(seq, n - 1)
            need = self.layout.blocks_for(n) - len(hit)
            if self.allocator.num_free - need - self.allocator.num_to_take(hit) < len(self.scheduler.running):
                return None
            self.prefix_cache.hit(hit, n)
            res = PullReservation(cached=hit, fresh=self.allocator.allocate(need))
            seq.block_table = res.blocks
            seq.status = RequestState.PULLING
            self.seqs[seq.request_id] = seq
            return res

    def finish_pull(self, seq: Sequence) -> None:
        """PULLING -> WAITING: the KV of all but its last token is in its blocks (pulled from a
        prefill worker or a draining decode worker, or cached here); it queues for a seat in the
        running batch, and its last generated token (replayed by make_sequence) is the next one
        to run. Its claim ends here. One aborted while it was pulled ends now, blocks freed."""
        with self.lock:
            self._take_claim(seq.request_id)
            if seq.request_id in self._abort_after_pull:
                self._abort_after_pull.discard(seq.request_id)
                out = self._aborted(seq)
            else:
                seq.num_computed = seq.num_tokens - 1
                self.prefix_cache.commit(seq)
                self.stats.prompt_tokens_total += len(seq.prompt_ids)
                self.scheduler.add_ready(seq)
                return
        self._emit(seq, out)

    def fail_pull(self, seq: Sequence) -> None:
        """PULLING -> FINISHED: the pull failed (or was cancelled); its blocks go back to the pool.
        Its claim stays with the caller (unclaim)."""
        with self.lock:
            self._abort_after_pull.discard(seq.request_id)
            self.seqs.pop(seq.request_id, None)
            self.prefix_cache.release(seq)
            seq.status = RequestState.FINISHED

    def withdraw(self, request_id: str) -> bool:
        """Take a request out of the queue if it has not started (its caller will not wait longer);
        False when it is running or gone."""
        with self.lock:
            seq = self.seqs.get(request_id)
            if seq is None or request_id in self._in_flight or not self.scheduler.withdraw(seq):
                return False
            del self.seqs[request_id]
            seq.status = RequestState.FINISHED
            return True
