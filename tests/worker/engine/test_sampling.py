"""Sampling: temperature, top-k, top-p and per-request seeds, reproducible wherever a token is drawn."""

from __future__ import annotations

import torch
from tandem.contracts.sampling import SamplingParams
from tandem.testing.engine_helpers import greedy, run_to_completion, submit, tokens_of
from tandem.worker.engine.sampling import filter_logits, sample

PROMPT = "Once upon a time there was a little model"


def test_top_k_keeps_exactly_k():
    logits = torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0])
    kept = torch.isfinite(filter_logits(logits, top_k=2, top_p=1.0))
    assert kept.tolist() == [False, True, False, True, False]


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    assert torch.isfinite(filter_logits(logits, -1, 0.5)).tolist() == [True, False, False, False]
    assert torch.isfinite(filter_logits(logits, -1, 0.8)).tolist() == [True, True, False, False]
    assert torch.isfinite(filter_logits(logits, -1, 0.81)).tolist() == [True, True, True, False]


def test_greedy_rows_take_the_argmax():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]])
    assert sample(logits, [SamplingParams(temperature=0)] * 2, [0, 0], [0, 0]) == [1, 0]


def test_temperature_sampling_draws_from_the_distribution():
    logits = torch.tensor([0.0, 1.0, 2.0])
    p = SamplingParams(temperature=1.0)
    draws = [sample(logits[None], [p], [7], [i])[0] for i in range(3000)]
    freq = torch.bincount(torch.tensor(draws), minlength=3).float() / len(draws)
    torch.testing.assert_close(freq, torch.softmax(logits, -1), atol=0.03, rtol=0)


def _run(eng, ids, params, rid):
    outs = submit(eng, rid, ids, params)
    run_to_completion(eng)
    return tokens_of(outs)


def test_seeded_requests_are_reproducible_and_seed_dependent(make_engine, loaded_toy):
    eng = make_engine()
    ids = loaded_toy.tokenizer(PROMPT)["input_ids"]
    p = dict(max_tokens=20, temperature=1.0, top_p=0.95, ignore_eos=True)
    a = _run(eng, ids, SamplingParams(seed=1234, **p), "a")
    b = _run(eng, ids, SamplingParams(seed=1234, **p), "b")
    c = _run(eng, ids, SamplingParams(seed=4321, **p), "c")
    assert a == b
    assert a != c


def test_seeded_output_does_not_depend_on_batch_or_preemption(make_engine, loaded_toy):
    ids = loaded_toy.tokenizer(PROMPT)["input_ids"]
    params = SamplingParams(max_tokens=24, temperature=0.8, top_k=50, seed=99, ignore_eos=True)
    alone = _run(make_engine(), ids, params, "alone")
    eng = make_engine(block_size=4, num_blocks=16, max_num_seqs=4)
    others = [submit(eng, f"o{i}", ids[: 4 + i], greedy(24)) for i in range(3)]
    mine = submit(eng, "mine", ids, params)
    run_to_completion(eng)
    assert eng.stats.preemptions_total > 0
    assert tokens_of(mine) == alone
    assert all(len(tokens_of(o)) == 24 for o in others)


def test_top_k_one_is_greedy(make_engine, loaded_toy):
    eng = make_engine()
    ids = loaded_toy.tokenizer(PROMPT)["input_ids"]
    g = _run(eng, ids, greedy(16), "g")
    k1 = _run(eng, ids, SamplingParams(max_tokens=16, temperature=1.5, top_k=1, seed=5, ignore_eos=True), "k")
    assert g == k1
