"""Continuous batching: which sequences run in the next forward pass, and how many tokens each.

Every step the decoding sequences go first (one token each), then the prompts: the next chunk of
each one being prefilled, and waiting ones admitted while the token budget, the prefill budget, the
sequence limit and the free blocks allow. Prompts take the prefill budget by priority, then by flow
(the tenant the router names, GenerateRequest.fairness_id): the flow served the fewest tokens lately
first, so a tenant's new prompt does not wait behind a flood's long prompts; within one flow, first
come, first served. While a flow served less lately is about (it had a sequence here in the last
FLOW_ACTIVE_S), those served more share flow_chunk_tokens of prompt tokens per step, and none in a
step that prefills its prompt: its next prompt arrives mid-step to a short step. The prefill budget caps the prompt
tokens of one step, so a long prompt is prefilled in chunks and the decoding sequences beside it
wait one chunk per step, never the whole prompt. When blocks run out the newest running sequence
is preempted: its blocks are freed and it is recomputed later, so its output does not change.
A sequence admitted starts from the longest prefix the prefix cache holds (prefix_cache.py) and
computes only the rest; a recomputed one finds the blocks it computed before, unless evicted.

Sequences whose prompt KV was pulled from a prefill worker wait in `ready` for a seat
(max_num_seqs holds for them too); a free seat goes to them first, and they decode in the step
that seats them, holding their blocks while they wait. When blocks run out, a ready sequence
gives its blocks back (it is recomputed from its prompt later) before any running stream is
preempted. Every allocation (here, and a pull's reservation) happens under the engine's lock
after checking the free count, so it never fails halfway through a step.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.worker.engine.block_allocator import BlockAllocator
from tandem.worker.engine.model_runner import BatchItem
from tandem.worker.engine.prefix_cache import PrefixCache
from tandem.worker.engine.request_state import RequestState
from tandem.worker.engine.request_table import RequestTable
from tandem.worker.engine.sequence import EngineSequence


@dataclass
class ScheduledChunk:
    """One sequence's part of a step, and what it is: a decode (one generated token) or a prefill
    chunk (prompt, recompute or replay tokens), fixed when it is scheduled (EngineSequence.decoding)."""

    seq: EngineSequence
    start: int  # position of the first token in the chunk (= seq.num_computed)
    num_tokens: int
    sample: bool  # the chunk reaches the sequence's last token: sample the next one
    prefill: bool = field(init=False)

    def __post_init__(self) -> None:
        self.prefill = not self.seq.decoding

    def batch_item(self) -> BatchItem:
        """What the runner is given of this chunk: its tokens, from where, over which blocks."""
        seq = self.seq
        return BatchItem(seq.all_ids[self.start : self.start + self.num_tokens], self.start, list(seq.block_table),
                         self.sample)


FLOW_SERVICE_HALF_LIFE_S = 10.0  # how fast a flow's service fades (_prompt_order)
# A flow with a sequence here this recently is about: the flows served more than it prefill short
# chunks (flow_chunk_tokens), so that its next prompt finds a short step in flight (_prompt_order).
FLOW_ACTIVE_S = 5.0


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        max_num_seqs: int,
        max_batched_tokens: int,
        on_preempt: Callable[[EngineSequence], None] | None = None,
        prefill_chunk_tokens: int | None = None,
        prefix_cache: PrefixCache | None = None,
        chunk_budget: Callable[[int], int] | None = None,
        requests: RequestTable | None = None,
        flow_chunk_tokens: int | None = None,
    ):
        """`requests`: the engine's request table, which moves the sequences between WAITING and
        RUNNING (a scheduler on its own gets a table of its own)."""
        self.requests = requests if requests is not None else RequestTable()
        self.allocator = allocator
        self.cache = prefix_cache or PrefixCache(allocator, block_size, b"", enabled=False)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.prefill_chunk_tokens = prefill_chunk_tokens or max_batched_tokens
        # Given the sequences decoding this step, the prompt tokens it may prefill (chunk_sizing.py);
        # None: always prefill_chunk_tokens.
        self.chunk_budget = chunk_budget
        self.waiting: deque[EngineSequence] = deque()  # prompts to prefill: new, or preempted
        self.ready: deque[EngineSequence] = deque()  # KV in the pool already (pulled): waiting for a seat
        self.running: list[EngineSequence] = []
        self.served: dict[str, float] = {}  # tokens scheduled per flow, fading (_prompt_order)
        # The prompt tokens per step of the flows served more than one about, all together (None: no
        # cap): a step in flight when its next prompt arrives is that short (_prompt_order).
        self.flow_chunk_tokens = flow_chunk_tokens
        self.capped: set[str] = set()  # the flows so capped, as of the last _prompt_order
        self.seen: dict[str, float] = {}  # when each flow last had a sequence here (FLOW_ACTIVE_S)
        self.clock = time.monotonic
        self.served_at = self.clock()
        self.on_preempt = on_preempt or (lambda seq: None)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def has_work(self) -> bool:
        return bool(self.waiting or self.ready or self.running)

    @property
    def num_queued(self) -> int:
        return len(self.waiting) + len(self.ready)

    def add(self, seq: EngineSequence) -> None:
        """A prompt to prefill here (NEW, or PULLING whose KV failed verification) -> WAITING."""
        self.requests.move(seq, RequestState.WAITING)
        self.waiting.append(seq)

    def add_ready(self, seq: EngineSequence) -> None:
        """A sequence whose KV is already in the pool (pulled from a prefill worker): PULLING -> WAITING."""
        self.requests.move(seq, RequestState.WAITING)
        self.ready.append(seq)

    def remove(self, seq: EngineSequence) -> None:
        """Take a sequence out of the queues and free its blocks (finish, abort, error)."""
        self.take_out(seq)
        self.free_blocks(seq)

    def take_out(self, seq: EngineSequence) -> None:
        """Take a sequence out of the queues, its blocks still held (a migration leases them)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.ready:
            self.ready.remove(seq)

    def withdraw(self, seq: EngineSequence) -> bool:
        """Take a sequence out of the queue if it has not started running (a caller that waited
        long enough); False when it runs already."""
        if seq in self.waiting and seq.num_computed == 0 and not seq.output_ids:
            self.waiting.remove(seq)
            self.free_blocks(seq)
            return True
        return False

    def free_blocks(self, seq: EngineSequence) -> None:
        self.cache.release(seq)

    def _recompute_later(self, seq: EngineSequence) -> None:
        self.free_blocks(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        if seq.status is RequestState.RUNNING:  # a pulled one still waiting for a seat stays WAITING
            self.requests.move(seq, RequestState.WAITING)
        self.waiting.appendleft(seq)
        self.on_preempt(seq)

    def preempt(self, seq: EngineSequence) -> None:
        self.running.remove(seq)
        self._recompute_later(seq)

    def _need(self, seq: EngineSequence, num_tokens: int) -> int:
        return max(0, self.blocks_for(seq.num_computed + num_tokens) - len(seq.block_table))

    def _grow(self, seq: EngineSequence, num_tokens: int) -> bool:
        need = self._need(seq, num_tokens)
        if need == 0:
            return True
        ids = self.allocator.try_allocate(need)
        if ids is None:
            return False
        seq.block_table.extend(ids)
        return True

    def _prompt_order(self, prompts: list[EngineSequence]) -> list[EngineSequence]:
        """Prompts (being prefilled, then waiting, each oldest first) in the order they take the prefill
        budget: higher priority first, then the flow this engine served the fewest tokens lately (least
        attained service, fading by half every FLOW_SERVICE_HALF_LIFE_S), then as they came. A tenant
        that floods has been served the most, so another tenant's prompt goes before its chunks, every
        step until it is prefilled; the flood takes the rest of the budget. (A fair share instead, as
        Sheng et al.'s virtual token counter, OSDI '24, would give the two tenants alternate chunks
        and double the other tenant's time to first token.) One flow at one priority keeps the order
        it had: first come, first served. Sets `capped`: the flows here served more than one about (had a
        sequence here within FLOW_ACTIVE_S), which share flow_chunk_tokens per step; a flow seen once
        long ago caps nobody, so a tenant alone keeps whole chunks. A request of no tenant (no
        fairness_id: the router's parity probes, a readiness check; the router names every client's
        flow) is never capped and caps nobody: a probe's prompt is prefilled in one chunk on both of
        its paths, as its exact comparison needs."""
        now = self.clock()
        fade = 0.5 ** ((now - self.served_at) / FLOW_SERVICE_HALF_LIFE_S)
        self.served_at = now
        here = {s.flow for s in (*self.running, *self.waiting, *self.ready)}
        self.served = {f: n * fade for f, n in self.served.items() if f in here or n * fade >= 1}
        self.seen = {f: t for f, t in self.seen.items() if now - t <= FLOW_ACTIVE_S} | dict.fromkeys(here, now)
        least = min((self.served.get(f, 0.0) for f in self.seen if f), default=0.0)
        self.capped = {f for f in here if f and self.served.get(f, 0.0) > least} if self.flow_chunk_tokens else set()
        if len(here) < 2 and len({s.priority for s in prompts}) < 2:
            return prompts
        return sorted(prompts, key=lambda s: (-s.priority, self.served.get(s.flow, 0.0)))

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_batched_tokens
        chunks: list[ScheduledChunk] = []
        # Pulled sequences take the free seats first: they decode in this very step.
        while self.ready and len(self.running) < self.max_num_seqs:
            seq = self.ready.popleft()
            self.requests.move(seq, RequestState.RUNNING)
            self.running.append(seq)
        prefill_budget = self.prefill_chunk_tokens
        if self.chunk_budget is not None:
            prefill_budget = min(prefill_budget, self.chunk_budget(sum(s.decoding for s in self.running)))
        # Decoding sequences first (one token each, so a long prompt's chunk never delays them), then
        # the prompts (_prompt_order): those being prefilled take their next chunk, waiting ones are
        # admitted while the budgets, the seats and the free blocks allow, none overtaking a waiting
        # one that did not fit. Preemption victims are running sequences, off the end.
        waiting = set(map(id, self.waiting))
        queue = [s for s in self.running if s.decoding] + self._prompt_order(
            [s for s in self.running if not s.decoding] + list(self.waiting))
        admitting, capped_budget = True, self.flow_chunk_tokens or 0
        while queue and budget > 0:
            seq = queue.pop(0)
            capped = seq.flow in self.capped
            step_budget = min(prefill_budget, capped_budget) if capped else prefill_budget
            if id(seq) in waiting:
                if step_budget <= 0:
                    continue  # its flow's tokens for this step are spent (not a prompt that did not fit)
                if not admitting or len(self.running) >= self.max_num_seqs:
                    continue
                admitting = self._admit(seq, budget, step_budget, chunks)
                if not admitting:
                    continue
            else:
                n = 1 if seq.decoding else self._tokens(seq.num_pending, budget, step_budget)
                if n == 0:
                    continue  # this step's prefill budget is spent: the prompt continues next step
                need = self._need(seq, n)
                while need > self.allocator.num_free and self.ready:
                    self._recompute_later(self.ready.pop())  # newest pulled one, before any stream
                while need > self.allocator.num_free and (victim := self._last_running(queue, waiting)) is not None:
                    self.preempt(victim)
                if need > self.allocator.num_free or not self._grow(seq, n):
                    # Nothing left to preempt but the sequences already scheduled this step: wait (the
                    # waiting prompts may still be admitted, should they need fewer blocks).
                    if not chunks:
                        self.preempt(seq)
                    queue = [s for s in queue if id(s) in waiting]
                    continue
                chunks.append(ScheduledChunk(seq, seq.num_computed, n, seq.num_computed + n == seq.num_tokens))
            n = chunks[-1].num_tokens
            budget -= n
            if chunks[-1].prefill or id(seq) in waiting:  # an admitted chunk was sized by the prefill budget
                prefill_budget -= n
                # A step that prefills the prompt of a flow served less carries none of the capped
                # flows' prompt tokens: its first token waits for no flood (they come first in order).
                capped_budget = capped_budget - n if capped else 0
        for c in chunks:
            self.served[c.seq.flow] = self.served.get(c.seq.flow, 0) + c.num_tokens
        return chunks

    @staticmethod
    def _last_running(queue: list[EngineSequence], waiting: set[int]) -> EngineSequence | None:
        """The last running sequence of this step's queue, taken out of it (a preemption victim)."""
        for i in range(len(queue) - 1, -1, -1):
            if id(queue[i]) not in waiting:
                return queue.pop(i)
        return None

    def _admit(self, seq: EngineSequence, budget: int, prefill_budget: int, chunks: list[ScheduledChunk]) -> bool:
        """A waiting prompt into a seat with its first chunk (appended to `chunks`), from the longest
        prefix the cache holds; False when it does not fit this step (nothing changed)."""
        hit = self.cache.match_to_compute(seq)
        cached = len(hit) * self.block_size
        n = self._tokens(seq.num_tokens - cached, budget, prefill_budget)
        need = self.blocks_for(cached + n) - len(hit) + self.allocator.num_to_take(hit)
        if n == 0 or need > self.allocator.num_free:
            return False
        self.waiting.remove(seq)
        self.requests.move(seq, RequestState.RUNNING)
        self.running.append(seq)
        self.cache.take(seq, hit, seq.num_tokens)
        seq.num_computed = cached
        self._grow(seq, n)  # room checked above, under the engine's lock
        chunks.append(ScheduledChunk(seq, seq.num_computed, n, seq.num_computed + n == seq.num_tokens))
        return True

    @staticmethod
    def _tokens(pending: int, budget: int, prefill_budget: int) -> int:
        """The prefill chunk this step may run of `pending` tokens still to prefill."""
        return max(0, min(pending, budget, prefill_budget))
