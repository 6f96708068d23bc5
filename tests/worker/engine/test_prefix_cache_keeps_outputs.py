"""Prefix caching changes how much is computed, never what comes out: greedy output (fp32) equals
transformers' generate and the engine with the cache off, alone and batched, with chunked
prefill, across preemption and eviction; the pool's books balance after every step."""

from __future__ import annotations

import torch
from tandem.contracts.prefix import block_hashes
from tandem.testing.engine_helpers import check_blocks_accounted, greedy, submit, tokens_of

BS = 4


def ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(3, 300, (n - 1,), generator=g).tolist()


SYSTEM = ids(37, 1)  # a shared "system prompt": 9 full blocks of 4 and one token


def run_checked(engine, max_steps: int = 10_000) -> int:
    """run_to_completion, checking the pool's books after every step."""
    steps = 0
    while engine.has_work():
        engine.step()
        check_blocks_accounted(engine)
        steps += 1
        assert steps < max_steps, "engine did not finish"
    return steps


def generate(engine, prompts: list[list[int]], n: int, tag: str) -> list[list[int]]:
    outs = [submit(engine, f"{tag}{i}", p, greedy(n)) for i, p in enumerate(prompts)]
    run_checked(engine)
    return [tokens_of(o) for o in outs]


def test_repeated_prompt_computes_only_its_tail(make_engine, reference):
    eng = make_engine(block_size=BS, max_waiting=64)
    for n in (45, 48):  # a partial last block, and a prompt of full blocks only
        p = ids(n, n)
        first = generate(eng, [p], 8, f"a{n}-")[0]
        q0, h0 = eng.prefix_cache.stats.query_tokens_total, eng.prefix_cache.stats.hit_tokens_total
        again = generate(eng, [p], 8, f"b{n}-")[0]
        assert first == again == reference(p, 8)
        # Every full block but the one holding the last token (at least one token is computed).
        assert eng.prefix_cache.stats.hit_tokens_total - h0 == (n - 1) // BS * BS
        assert eng.prefix_cache.stats.query_tokens_total - q0 == n
    assert eng.allocator.num_cached > 0 and eng.allocator.num_used == 0


def test_shared_prefix_batched_equals_cache_off_and_transformers(make_engine, reference):
    on, off = make_engine(block_size=BS, max_waiting=64), make_engine(block_size=BS, prefix_caching=False)
    warm = SYSTEM + ids(9, 50)
    prompts = [SYSTEM + ids(k, 60 + k) for k in (2, 5, 11, 20)] + [warm, SYSTEM[:30]]
    want = [reference(p, 10) for p in prompts]
    for eng in (on, off):
        assert generate(eng, [warm], 10, "w") == [want[4]]
        assert generate(eng, prompts, 10, "s") == want  # all at once, in one batch
    assert off.prefix_cache.stats.hit_tokens_total == 0 and off.allocator.num_cached == 0
    # Each batched prompt found the system prompt's 9 full blocks (SYSTEM[:30]: its 7 full blocks).
    assert on.prefix_cache.stats.hit_tokens_total >= (5 * 9 + 7) * BS


def test_next_turn_reuses_the_previous_turns_output(make_engine, reference):
    """A chat's next turn resends prompt + answer + a new message: the answer's KV is reused too."""
    eng = make_engine(block_size=BS, max_waiting=64)
    turn1 = SYSTEM + ids(12, 7)
    answer = generate(eng, [turn1], 12, "t1-")[0]
    turn2 = turn1 + answer + ids(10, 8)[1:]
    h0 = eng.prefix_cache.stats.hit_tokens_total
    assert generate(eng, [turn2], 12, "t2-")[0] == reference(turn2, 12)
    # The last answer token was sampled, never run through the model: blocks before it are cached.
    assert eng.prefix_cache.stats.hit_tokens_total - h0 == (len(turn1) + len(answer) - 1) // BS * BS


def test_chunked_prefill_with_cache(make_engine, reference):
    eng = make_engine(block_size=BS, max_waiting=64, max_batched_tokens=8, max_num_seqs=4)
    prompts = [SYSTEM + ids(k, 80 + k) for k in (6, 13)]
    assert generate(eng, prompts[:1], 6, "c") == [reference(prompts[0], 6)]
    assert generate(eng, prompts, 6, "d") == [reference(p, 6) for p in prompts]
    assert eng.prefix_cache.stats.hit_tokens_total > 0


def test_preemption_with_shared_blocks_keeps_outputs(make_engine, reference):
    # Four sequences of ~45 prompt + 24 new tokens, sharing a 37-token prefix, in 30 blocks of 4.
    eng = make_engine(block_size=BS, max_waiting=64, num_blocks=30, max_num_seqs=4, max_batched_tokens=128)
    prompts = [SYSTEM + ids(k, 90 + k) for k in (4, 7, 9, 12)]
    assert generate(eng, prompts, 24, "p") == [reference(p, 24) for p in prompts]
    assert eng.stats.preemptions_total > 0, "the pool was meant to be too small for all four"
    assert eng.prefix_cache.stats.hit_tokens_total > 0


def test_evicted_blocks_are_recomputed_never_read(make_engine, reference):
    eng = make_engine(block_size=BS, max_waiting=64, num_blocks=24, max_num_seqs=1, max_batched_tokens=128)
    first = ids(40, 3)
    assert generate(eng, [first], 6, "e0-") == [reference(first, 6)]
    held = set(eng.cached_block_hashes())
    mine = block_hashes(first, BS, eng.prefix_hash_salt)
    assert set(mine) <= held
    others = [ids(60, 100 + i) for i in range(3)]  # each needs 17 of the 24 blocks: evicts the first
    assert generate(eng, others, 6, "e") == [reference(p, 6) for p in others]
    assert eng.allocator.evictions_total > 0
    gone = [h for h in mine if h not in set(eng.cached_block_hashes())]
    assert gone, "the first prompt's blocks were meant to be evicted"
    h0 = eng.prefix_cache.stats.hit_tokens_total
    assert generate(eng, [first], 6, "e1-") == [reference(first, 6)]
    # Hits stop at the first evicted block: what is found is only what is still named.
    assert eng.prefix_cache.stats.hit_tokens_total - h0 == min(mine.index(gone[0]), (40 - 1) // BS) * BS


def test_leased_prefill_blocks_are_cached_once_released(make_engine, loaded_toy):
    from tandem.contracts.protocol import GenerateRequest

    eng = make_engine(block_size=BS, max_waiting=64)
    p = SYSTEM + ids(8, 4)
    firsts = []
    for rid in ("l1", "l2"):
        seq = eng.make_sequence(GenerateRequest(request_id=rid, prompt_token_ids=p, sampling=greedy(4)),
                                prefill_only=True)
        outs = []
        seq.sink = outs.append
        eng.add(seq)
        run_checked(eng)
        assert outs[-1].kv_blocks == eng.leases[rid].seq.block_table
        firsts.append(outs[-1].token_ids)
        check_blocks_accounted(eng)
        assert eng.abort(rid, eng.lease_token(rid))
    assert firsts[0] == firsts[1]
    assert eng.prefix_cache.stats.hit_tokens_total == (len(p) - 1) // BS * BS  # the second one's
    check_blocks_accounted(eng)
    assert eng.allocator.num_used == 0 and eng.allocator.num_cached_free == len(p) // BS


def test_books_balance_after_mixed_traffic(make_engine):
    """Finished, aborted (waiting and running), preempted, leased and released sequences: every
    reference is given back, and what stays is cached and free."""
    from tandem.contracts.protocol import GenerateRequest

    eng = make_engine(block_size=BS, max_waiting=64, num_blocks=40, max_num_seqs=4, max_batched_tokens=32)
    for i in range(3):
        submit(eng, f"run{i}", SYSTEM + ids(10 + i, 200 + i), greedy(20))
    submit(eng, "abort-waiting", SYSTEM + ids(5, 210), greedy(20))
    lease = eng.make_sequence(GenerateRequest(request_id="lease", prompt_token_ids=SYSTEM + ids(6, 211),
                                              sampling=greedy(4)), prefill_only=True)
    eng.add(lease)
    for step in range(12):
        eng.step()
        check_blocks_accounted(eng)
        if step == 3:
            eng.abort("run1")
            eng.abort("abort-waiting")
    run_checked(eng)
    assert eng.leases and eng.abort("lease", eng.lease_token("lease"))
    check_blocks_accounted(eng)
    assert eng.allocator.num_used == 0
    assert all(eng.allocator.refcount(b) == 0 for b in range(eng.allocator.num_blocks))
    assert eng.allocator.num_free == eng.allocator.num_blocks
    assert eng.allocator.num_cached_free == eng.allocator.num_cached > 0


def test_cache_off_computes_everything(make_engine, reference):
    eng = make_engine(block_size=BS, max_waiting=64, prefix_caching=False)
    p = ids(30, 9)
    assert generate(eng, [p, p], 5, "o") == [reference(p, 5)] * 2
    assert eng.prefix_cache.stats.query_tokens_total == eng.prefix_cache.stats.hit_tokens_total == 0
    assert eng.allocator.num_cached == 0 and not eng.cached_block_hashes()
    follow = (lambda *snapshot: None, lambda stored, removed: None)
    assert not eng.follow_kv_events(*follow)  # its KV event stream says it has no cache
    assert make_engine(block_size=BS, max_waiting=64).follow_kv_events(*follow)
