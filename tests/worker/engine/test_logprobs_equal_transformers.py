"""Logprobs (the chosen token's and the top-k alternatives) equal torch.log_softmax of transformers'
own logits in fp32 for the same tokens, sampled or greedy, alone or in a batch with rows that ask
for none; rows that ask for none get none."""

from __future__ import annotations

import pytest
import torch
from tandem.contracts.sampling import SamplingParams
from tandem.testing.engine_helpers import run_to_completion, submit, tokens_of

PROMPT = "The router sends the prompt to a prefill worker and streams tokens"


def _reference(hf_model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every generated position: [len(generated), vocab]."""
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = hf_model(ids).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)], dim=-1)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_logprobs_equal_log_softmax_of_transformers_logits(make_engine, loaded_toy, hf_toy, temperature):
    eng = make_engine()
    ids = loaded_toy.tokenizer(PROMPT)["input_ids"]
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=3, ignore_eos=True, logprobs=5)
    mine = submit(eng, "lp", ids, params)
    plain = submit(eng, "plain", ids[:5], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    run_to_completion(eng)
    toks = tokens_of(mine)
    entries = [lp for o in mine for lp in (o.logprobs or [])]
    assert len(entries) == len(toks) == 12
    assert all(o.logprobs is None for o in plain)
    ref = _reference(hf_toy, ids, toks)
    for i, (tok, e) in enumerate(zip(toks, entries, strict=True)):
        assert e.token_id == tok
        assert e.logprob == pytest.approx(ref[i, tok].item(), abs=1e-4)
        top = torch.topk(ref[i], 5)
        assert [t for t, _ in e.top] == top.indices.tolist()
        assert [lp for _, lp in e.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_logprobs_zero_gives_the_chosen_token_only(make_engine, loaded_toy):
    eng = make_engine()
    ids = loaded_toy.tokenizer(PROMPT)["input_ids"]
    outs = submit(eng, "lp0", ids, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=0))
    run_to_completion(eng)
    entries = [lp for o in outs for lp in o.logprobs]
    assert len(entries) == 3 and all(e.top == [] and e.logprob <= 0 for e in entries)
