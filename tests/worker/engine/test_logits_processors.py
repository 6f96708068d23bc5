"""The sampling controls, batched over the rows that use them: each changes exactly what it
should (checked on hand-made logits against a per-row reference) and leaves other rows alone."""

from __future__ import annotations

import torch
from tandem.contracts.sampling import SamplingParams
from tandem.testing.engine_helpers import greedy, run_to_completion, submit, tokens_of
from tandem.worker.engine.logits_processors import apply_processors
from tandem.worker.engine.sampling import SampleRow, filter_logits, sample_batch

V = 8


def _row(**kw) -> SampleRow:
    hist = {k: kw.pop(k) for k in ("prompt_ids", "output_ids", "eos_ids") if k in kw}
    p = SamplingParams(temperature=0.0, **kw)
    return SampleRow(p, 0, len(hist.get("output_ids", [])), **hist)


def test_penalties_match_their_definitions():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0, 1.0, -2.0, 0.2]] * 4)
    rows = [
        _row(repetition_penalty=2.0, prompt_ids=[0], output_ids=[1, 1]),
        _row(frequency_penalty=0.5, output_ids=[3, 3, 5]),
        _row(presence_penalty=0.7, output_ids=[3, 3, 5]),
        _row(output_ids=[3, 3]),  # no control: untouched
    ]
    out = apply_processors(logits.clone(), rows)
    exp = logits.clone()
    exp[0, 0], exp[0, 1] = 2.0 / 2, -1.0 * 2  # positive logits divided, negative multiplied
    exp[1, 3], exp[1, 5] = 3.0 - 1.0, 1.0 - 0.5
    exp[2, 3], exp[2, 5] = 3.0 - 0.7, 1.0 - 0.7
    torch.testing.assert_close(out, exp)


def test_logit_bias_and_min_tokens():
    logits = torch.zeros(3, V)
    rows = [
        _row(logit_bias={"2": 5.0, "6": -100.0}),
        _row(min_tokens=2, stop_token_ids=[4], eos_ids=frozenset({1}), output_ids=[7]),
        _row(min_tokens=1, eos_ids=frozenset({1}), output_ids=[7]),  # already past min_tokens
    ]
    out = apply_processors(logits.clone(), rows)
    assert out[0, 2] == 5.0 and out[0, 6] == -100.0 and out[0, 0] == 0.0
    assert out[1, 1] == out[1, 4] == float("-inf") and torch.isfinite(out[1, [0, 2, 3, 5, 6, 7]]).all()
    assert torch.isfinite(out[2]).all()


def test_min_p_drops_tokens_below_a_fraction_of_the_likeliest():
    probs = torch.tensor([0.5, 0.3, 0.12, 0.08])
    kept = torch.isfinite(filter_logits(probs.log(), -1, 1.0, min_p=0.2)).tolist()
    assert kept == [True, True, True, False]  # 0.08 < 0.2 * 0.5


def test_greedy_row_with_bias_takes_the_biased_token_while_its_neighbour_keeps_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, 3.0, 1.0]])
    rows = [SampleRow(SamplingParams(temperature=0, logit_bias={"2": 10.0}), 0, 0),
            SampleRow(SamplingParams(temperature=0), 0, 0)]
    assert sample_batch(logits, rows, argmax=logits.argmax(-1))[0] == [2, 1]


def test_min_tokens_and_stop_token_ids_in_the_engine(make_engine, loaded_toy):
    """stop_token_ids end the output at that token; min_tokens keeps EOS and them out until then."""
    eng = make_engine()
    ids = loaded_toy.tokenizer("She sells sea shells")["input_ids"]
    free = submit(eng, "free", ids, greedy(30))
    run_to_completion(eng)
    base = tokens_of(free)
    stop_tok = base[4]
    stopped = submit(eng, "stop", ids, greedy(30, stop_token_ids=[stop_tok]))
    held = submit(eng, "min", ids, greedy(30, stop_token_ids=[stop_tok], min_tokens=10))
    run_to_completion(eng)
    first = base.index(stop_tok)
    assert tokens_of(stopped) == base[: first + 1] and stopped[-1].finish_reason == "stop"
    assert stop_tok not in tokens_of(held)[:10] and len(tokens_of(held)) >= 10


def test_repetition_penalty_changes_a_looping_greedy_output(make_engine, loaded_toy):
    eng = make_engine()
    ids = loaded_toy.tokenizer("She sells sea shells")["input_ids"]
    a = submit(eng, "a", ids, greedy(40))
    b = submit(eng, "b", ids, greedy(40, repetition_penalty=1.8))
    run_to_completion(eng)
    ta, tb = tokens_of(a), tokens_of(b)
    assert ta != tb
    assert len(set(tb)) >= len(set(ta))  # penalising seen tokens spreads the output over more of them


def test_a_top_p_that_rounds_to_zero_keeps_the_likeliest_token():
    """top_p 1e-300 is 0 in float32: the likeliest token still stays (a NaN draw failed the request)."""
    rows = [SampleRow(SamplingParams(temperature=1.0, top_p=1e-300), 3, 0)]
    assert sample_batch(torch.tensor([[0.0, 2.0, 1.0]]), rows)[0] == [1]
