"""Teacher forcing (SamplingParams.forced_token_ids, what the router's handoff parity probe sends):
the engine emits exactly the given tokens and scores each with the model's raw log probability, the
same as transformers' log_softmax at that position; a sequence that arrives with tokens already
generated (a handoff's first token) continues the forcing from its output index; bad forcing is
refused where it enters."""

from __future__ import annotations

import pytest
import torch
from tandem.contracts.protocol import GenerateRequest
from tandem.contracts.sampling import SamplingParams
from tandem.testing.engine_helpers import run_to_completion, submit, tokens_of
from tandem.worker.engine.errors import RequestError
from tandem.worker.engine.request_checks import check_sampling

PROMPT = "A handoff that proves itself compares log probabilities"
FORCED = [7, 300, 42, 42, 511, 3]


def _reference(hf_model, prompt: list[int], given: list[int]) -> list[float]:
    ids = torch.tensor([prompt + given])
    with torch.no_grad():
        logits = hf_model(ids).logits[0].float()
    lps = torch.log_softmax(logits[len(prompt) - 1: len(prompt) - 1 + len(given)], dim=-1)
    return [lps[i, t].item() for i, t in enumerate(given)]


def test_forced_tokens_come_out_scored_like_transformers(make_engine, loaded_toy, hf_toy):
    eng = make_engine()
    ids = loaded_toy.tokenizer(PROMPT)["input_ids"]
    params = SamplingParams(max_tokens=len(FORCED), temperature=0, ignore_eos=True, logprobs=0,
                            forced_token_ids=FORCED)
    outs = submit(eng, "forced", ids, params)
    greedy = submit(eng, "free", ids, SamplingParams(max_tokens=len(FORCED), temperature=0, ignore_eos=True))
    run_to_completion(eng)
    assert tokens_of(outs) == FORCED
    assert tokens_of(greedy) != FORCED, "the forced tokens are not what greedy decoding picks"
    scored = [lp.logprob for o in outs for lp in o.logprobs]
    assert scored == pytest.approx(_reference(hf_toy, ids, FORCED), abs=1e-4)


def test_forcing_continues_after_replayed_tokens(make_engine, loaded_toy):
    """A handoff's decode side gets the first token as generated_token_ids: forcing resumes at index 1,
    and the scores are those of one sequence forced from the start."""
    eng = make_engine()
    ids = loaded_toy.tokenizer(PROMPT)["input_ids"]
    params = SamplingParams(max_tokens=len(FORCED), temperature=0, ignore_eos=True, logprobs=0,
                            forced_token_ids=FORCED)
    whole = submit(eng, "whole", ids, params)
    run_to_completion(eng)
    req = GenerateRequest("rest", prompt_token_ids=ids, sampling=params, generated_token_ids=FORCED[:1])
    rest: list = []
    seq = eng.make_sequence(req)
    seq.sink = rest.append
    eng.add(seq)
    run_to_completion(eng)
    assert tokens_of(rest) == FORCED[1:]
    # Not bit-equal: here the replayed token is recomputed in the prompt chunk, not in a decode step
    # (a different kernel; the probe's two paths both decode it, see router/parity/probe.py).
    expected = [lp.logprob for o in whole for lp in o.logprobs][1:]
    assert [lp.logprob for o in rest for lp in o.logprobs] == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("forced, why", [
    ([512], "token ids in [0, 512)"),
    ([1] * 7, "at most max_tokens"),
    (["1"], "token ids"),
])
def test_bad_forcing_is_refused_where_it_enters(forced, why):
    params = SamplingParams(max_tokens=6, forced_token_ids=forced)
    with pytest.raises(RequestError, match="forced_token_ids") as err:
        check_sampling(params, vocab_size=512)
    assert why.split()[0] in str(err.value) and err.value.param == "forced_token_ids"
