"""Scheduling rules, without a model: running sequences first, the token budget, chunking, the
sequence limit, first-come-first-served admission and preemption of the newest sequence."""

from __future__ import annotations

from tandem.contracts.sampling import SamplingParams
from tandem.worker.engine.block_allocator import BlockAllocator
from tandem.worker.engine.request_state import RequestState
from tandem.worker.engine.scheduler import Scheduler
from tandem.worker.engine.sequence import EngineSequence


def _seq(rid: str, n: int) -> EngineSequence:
    return EngineSequence(rid, list(range(n)), SamplingParams(), max_total_len=4096, seed=0)


def _advance(chunks, token=7):
    """What the engine does after a forward pass: count computed tokens, append the samples."""
    for c in chunks:
        c.seq.num_computed += c.num_tokens
        if c.sample:
            c.seq.output_ids.append(token)


def test_budget_chunks_long_prompts_and_decodes_go_first():
    s = Scheduler(BlockAllocator(100), block_size=4, max_num_seqs=8, max_batched_tokens=10)
    a, b = _seq("a", 3), _seq("b", 25)
    s.add(a)
    s.add(b)
    chunks = s.schedule()
    assert [(c.seq.request_id, c.num_tokens, c.sample) for c in chunks] == [("a", 3, True), ("b", 7, False)]
    _advance(chunks)
    chunks = s.schedule()  # a decodes (1 token), b's next chunk takes the rest of the budget
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in chunks] == [("a", 3, 1), ("b", 7, 9)]


def test_max_num_seqs_and_fcfs():
    s = Scheduler(BlockAllocator(100), block_size=4, max_num_seqs=2, max_batched_tokens=100)
    seqs = [_seq(str(i), 2) for i in range(3)]
    for q in seqs:
        s.add(q)
    chunks = s.schedule()
    assert [c.seq.request_id for c in chunks] == ["0", "1"]
    assert seqs[2].status == RequestState.WAITING


def test_preempts_newest_when_blocks_run_out():
    alloc = BlockAllocator(4)
    s = Scheduler(alloc, block_size=2, max_num_seqs=4, max_batched_tokens=100)
    old, new = _seq("old", 4), _seq("new", 4)
    s.add(old)
    s.add(new)
    _advance(s.schedule())
    assert alloc.num_free == 0
    chunks = s.schedule()  # old needs a third block: new is preempted and its blocks freed
    assert [c.seq.request_id for c in chunks] == ["old"]
    assert new.status == RequestState.WAITING and new.num_computed == 0 and not new.block_table
    assert s.waiting[0] is new and new.num_preemptions == 1
    s.remove(old)
    s.remove(new)
    assert alloc.num_used == 0


def test_decodes_are_scheduled_before_an_older_prompts_chunk():
    """A decode worker prefilling a long prompt locally must not stall the sequences whose KV it
    pulled: they decode first, the prompt's chunk gets the rest of the budget."""
    alloc = BlockAllocator(100)
    s = Scheduler(alloc, block_size=4, max_num_seqs=8, max_batched_tokens=8)
    old = _seq("old", 40)
    s.add(old)
    _advance(s.schedule())
    assert old.num_computed == 8
    pulled = _seq("pulled", 5)  # KV for 5 prompt tokens pulled into 2 blocks, first token known
    pulled.output_ids, pulled.num_computed, pulled.block_table = [9], 5, alloc.allocate(2)
    s.add_ready(pulled)
    chunks = s.schedule()
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in chunks] == [("pulled", 5, 1), ("old", 8, 7)]


def test_prefill_budget_caps_prompt_tokens_per_step_never_decodes():
    """A colocated worker's prefill budget: each step prefills at most that many prompt tokens
    (all prompts together), while every decoding sequence still gets its token."""
    s = Scheduler(BlockAllocator(100), block_size=4, max_num_seqs=8, max_batched_tokens=64,
                  prefill_chunk_tokens=6)
    a = _seq("a", 3)
    s.add(a)
    _advance(s.schedule())
    b, c = _seq("b", 20), _seq("c", 5)
    s.add(b)
    s.add(c)
    chunks = s.schedule()
    assert [(x.seq.request_id, x.start, x.num_tokens) for x in chunks] == [("a", 3, 1), ("b", 0, 6)]
    assert c.status == RequestState.WAITING  # the budget is spent: c waits although tokens remain
    _advance(chunks)
    chunks = s.schedule()
    assert [(x.seq.request_id, x.start, x.num_tokens) for x in chunks] == [("a", 4, 1), ("b", 6, 6)]
    for _ in range(2):
        _advance(chunks)
        chunks = s.schedule()
    # b's last 2 prompt tokens, then c's first 4 share one step's budget of 6
    assert [(x.seq.request_id, x.start, x.num_tokens) for x in chunks] == [("a", 6, 1), ("b", 18, 2), ("c", 0, 4)]


def test_a_one_token_prompt_is_a_prefill_and_a_pulled_sequence_a_decode():
    """One answer to "is this chunk a prefill?" (EngineSequence.decoding, ScheduledChunk.prefill): a
    one-token prompt is prefilled (after the decodes, charged to the prefill budget, counted as
    prompt by the engine's stats and chunk sizer), a sequence whose KV was pulled decodes."""
    s = Scheduler(BlockAllocator(100), block_size=4, max_num_seqs=8, max_batched_tokens=64,
                  prefill_chunk_tokens=4)
    streaming, one, long = _seq("streaming", 3), _seq("one", 1), _seq("long", 8)
    s.add(streaming)
    _advance(s.schedule())
    assert streaming.decoding and not one.decoding
    s.add(long)
    s.add(one)
    chunks = s.schedule()  # the decode first; the long prompt takes the whole prefill budget of 4
    assert [(c.seq.request_id, c.num_tokens, c.prefill) for c in chunks] == [("streaming", 1, False),
                                                                             ("long", 4, True)]
    _advance(chunks)
    chunks = s.schedule()  # the rest of long's prompt fills the budget again: the one-token prompt waits
    assert [(c.seq.request_id, c.num_tokens, c.prefill) for c in chunks] == [("streaming", 1, False),
                                                                             ("long", 4, True)]
    _advance(chunks)
    chunks = s.schedule()
    assert [(c.seq.request_id, c.num_tokens, c.prefill) for c in chunks] == [
        ("streaming", 1, False), ("long", 1, False), ("one", 1, True)]
    pulled = _seq("pulled", 6)
    s.requests.move(pulled, RequestState.PULLING)
    pulled.output_ids.append(9)
    pulled.num_computed = pulled.num_tokens - 1
    pulled.block_table = s.allocator.try_allocate(2)
    s.add_ready(pulled)
    assert pulled.decoding
    _advance(chunks)
    assert ("pulled", 1, False) in [(c.seq.request_id, c.num_tokens, c.prefill) for c in s.schedule()]
