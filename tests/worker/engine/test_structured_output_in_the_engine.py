"""Structured output in the engine: a random-weight model's output, masked by the grammar at every
step, parses and validates against the schema and ends by itself (stop) well within max_tokens;
the grammar's state survives a replay (a handoff's first token, a resume) exactly; a bad schema
is a 400 naming response_format."""

from __future__ import annotations

import json

import pytest
from tandem.contracts.protocol import FinishReason, GenerateRequest
from tandem.contracts.sampling import SamplingParams
from tandem.testing.engine_helpers import run_to_completion, submit, text_of, tokens_of
from tandem.testing.schemas import PERSON, validate_person
from tandem.worker.engine.errors import RequestError


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_schema_constrained_output_parses_and_validates(make_engine, loaded_toy, temperature):
    eng = make_engine()
    ids = loaded_toy.tokenizer("Give me a person as JSON")["input_ids"]
    outs = [submit(eng, f"r{s}", ids, SamplingParams(max_tokens=120, temperature=temperature, seed=s,
                                                     structured={"json_schema": PERSON}))
            for s in range(4)]
    plain = submit(eng, "plain", ids, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    run_to_completion(eng)
    for o in outs:
        assert o[-1].finish_reason == FinishReason.STOP, text_of(o)
        validate_person(json.loads(text_of(o)))
    assert len(tokens_of(plain)) == 20  # its unconstrained neighbour is untouched


def test_grammar_state_survives_a_replay(make_engine, loaded_toy):
    """A request resumed with its first k tokens (as a decode worker gets them) continues exactly."""
    eng = make_engine()
    ids = loaded_toy.tokenizer("Give me a person as JSON")["input_ids"]
    params = SamplingParams(max_tokens=120, temperature=1.0, seed=7, structured={"json_schema": PERSON})
    whole = submit(eng, "whole", ids, params)
    run_to_completion(eng)
    toks = tokens_of(whole)
    for k in (1, len(toks) // 2):
        seq = eng.make_sequence(GenerateRequest(request_id=f"k{k}", prompt_token_ids=ids, sampling=params,
                                                generated_token_ids=toks[:k]))
        outs: list = []
        seq.sink = outs.append
        eng.add(seq)
        run_to_completion(eng)
        assert toks[:k] + tokens_of(outs) == toks


def test_replayed_tokens_that_break_the_grammar_are_refused(make_engine, loaded_toy):
    eng = make_engine()
    ids = loaded_toy.tokenizer("JSON please")["input_ids"]
    letter = loaded_toy.tokenizer("x", add_special_tokens=False)["input_ids"][0]
    req = GenerateRequest(request_id="bad", prompt_token_ids=ids, generated_token_ids=[letter],
                          sampling=SamplingParams(max_tokens=8, structured={"json_object": True}))
    with pytest.raises(RequestError) as info:
        eng.make_sequence(req)
    assert info.value.param == "generated_token_ids"


@pytest.mark.parametrize("spec", [{"json_schema": {"type": "objectx"}}, {"regex": "[a-"}, {"lark": "start: foo"},
                                  {"choice": []}, {"json_object": True, "regex": "a"}])
def test_a_bad_grammar_is_a_400_naming_response_format(make_engine, loaded_toy, spec):
    eng = make_engine()
    req = GenerateRequest(request_id="g", prompt="hi", sampling=SamplingParams(max_tokens=4, structured=spec))
    with pytest.raises(RequestError) as info:
        eng.make_sequence(req)
    assert info.value.status == 400 and info.value.param == "response_format"


def test_choice_and_regex_constrain_the_text(make_engine, loaded_toy):
    eng = make_engine()
    ids = loaded_toy.tokenizer("Pick one")["input_ids"]
    choice = submit(eng, "c", ids, SamplingParams(max_tokens=30, temperature=1.0, seed=1,
                                                  structured={"choice": ["positive", "negative"]}))
    regex = submit(eng, "r", ids, SamplingParams(max_tokens=30, temperature=1.0, seed=2,
                                                 structured={"regex": "[0-9]{3}-[a-c]{2}"}))
    run_to_completion(eng)
    assert text_of(choice) in ("positive", "negative")
    import re

    assert re.fullmatch("[0-9]{3}-[a-c]{2}", text_of(regex))
