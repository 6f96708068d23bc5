"""Preemption (blocks run out: a sequence is freed and recomputed later) and chunked prefill (a
prompt split over steps under the token budget) do not change a single output token."""

from __future__ import annotations

from tandem.testing.engine_helpers import greedy, run_to_completion, submit, tokens_of

PROMPTS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "Kubernetes schedules pods onto nodes, and an operator reconciles what it observes.",
    "Hello, world! How are you today?",
    "Continuous batching lets sequences join and leave the running batch at every step.",
]


def test_preemption_keeps_outputs(make_engine, loaded_toy, reference):
    # 4 sequences of ~20-25 prompt + 24 new tokens need ~12 blocks of 4 each; the pool has 20.
    eng = make_engine(block_size=4, num_blocks=20, max_num_seqs=4, max_batched_tokens=128)
    prompt_ids = [loaded_toy.tokenizer(p)["input_ids"] for p in PROMPTS]
    outs = [submit(eng, f"p{i}", ids, greedy(24)) for i, ids in enumerate(prompt_ids)]
    run_to_completion(eng)
    assert eng.stats.preemptions_total > 0, "the pool was meant to be too small for all four"
    for i, ids in enumerate(prompt_ids):
        assert tokens_of(outs[i]) == reference(ids, 24), f"sequence {i} changed after preemption"


def test_chunked_prefill_keeps_outputs(make_engine, loaded_toy, reference):
    eng = make_engine(block_size=4, max_batched_tokens=8, max_num_seqs=4)
    prompt_ids = [loaded_toy.tokenizer(p)["input_ids"] for p in PROMPTS[:3]]
    assert all(len(ids) > 8 for ids in prompt_ids)
    outs = [submit(eng, f"c{i}", ids, greedy(12)) for i, ids in enumerate(prompt_ids)]
    steps = run_to_completion(eng)
    total_prompt = sum(len(ids) for ids in prompt_ids)
    assert steps >= total_prompt // 8, "prompts were meant to be split into chunks of 8 tokens"
    for i, ids in enumerate(prompt_ids):
        assert tokens_of(outs[i]) == reference(ids, 12), f"sequence {i} changed with chunked prefill"


def test_max_num_seqs_limits_the_running_batch(make_engine, loaded_toy, reference):
    eng = make_engine(max_num_seqs=2, max_batched_tokens=64)
    prompt_ids = [loaded_toy.tokenizer(p)["input_ids"] for p in PROMPTS]
    outs = [submit(eng, f"m{i}", ids, greedy(6)) for i, ids in enumerate(prompt_ids)]
    peak = 0
    while eng.has_work():
        eng.step()
        peak = max(peak, eng.num_running)
    assert peak == 2
    for i, ids in enumerate(prompt_ids):
        assert tokens_of(outs[i]) == reference(ids, 6)


def test_pool_sized_from_a_memory_fraction(make_engine):
    eng = make_engine(num_blocks=None, kv_memory_fraction=0.001)
    assert eng.layout.num_blocks >= 1
    assert tuple(eng.pool.shape) == eng.layout.shape and eng.pool.is_contiguous()
    assert eng.pool.numel() * eng.pool.element_size() == eng.layout.num_blocks * eng.layout.block_bytes
