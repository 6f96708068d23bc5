"""Every sampling parameter is checked where it enters the engine: numbers finite and in range, a
temperature too small to divide by taken as greedy (the issue's 1e-300, as the worker's parsing
also does), stop strings within the worker's limits, a prompt the tokenizer refuses a 400."""

from __future__ import annotations

import pytest
from tandem.contracts.protocol import GenerateRequest
from tandem.contracts.sampling import WORKER_MAX_STOP_CHARS, WORKER_MAX_STOP_STRINGS, SamplingParams
from tandem.testing.engine_helpers import run_to_completion, submit, tokens_of
from tandem.worker.engine.errors import RequestError

PROMPT = "Hello, world!"
INF = float("inf")


@pytest.mark.parametrize(("sampling", "param"), [
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": INF}, "temperature"),
    ({"temperature": -1e-9}, "temperature"),
    ({"top_p": float("nan")}, "top_p"),
    ({"top_p": INF}, "top_p"),
    ({"top_k": True}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"stop": ["x"] * (WORKER_MAX_STOP_STRINGS + 1)}, "stop"),
    ({"stop": ["y" * (WORKER_MAX_STOP_CHARS + 1)]}, "stop"),
    ({"stop": [3]}, "stop"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
])
def test_out_of_range_parameters_are_a_400(make_engine, sampling, param):
    eng = make_engine()
    req = GenerateRequest(request_id="bad", prompt=PROMPT, sampling=SamplingParams(**sampling))
    with pytest.raises(RequestError) as e:
        eng.make_sequence(req)
    assert (e.value.status, e.value.param, e.value.code) == (400, param, "invalid_value")


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 9.9e-6, 0])
def test_a_temperature_below_the_epsilon_is_greedy(make_engine, loaded_toy, reference, temperature):
    eng = make_engine()
    ids = loaded_toy.tokenizer(PROMPT)["input_ids"]
    outs = submit(eng, "t", ids, SamplingParams(max_tokens=8, temperature=temperature, ignore_eos=True))
    run_to_completion(eng)
    assert tokens_of(outs) == reference(ids, 8)


def test_limits_hold_at_their_edge(make_engine):
    eng = make_engine()
    stop = ["z" * WORKER_MAX_STOP_CHARS] * WORKER_MAX_STOP_STRINGS
    seq = eng.make_sequence(GenerateRequest(request_id="edge", prompt=PROMPT, sampling=SamplingParams(
        stop=stop, seed=2**64 - 1, temperature=1e-5, top_p=1)))
    assert seq.params.temperature == 1e-5 and seq.detok.stop == stop


def test_a_prompt_the_tokenizer_refuses_is_a_400(make_engine):
    eng = make_engine()

    class Refusing:
        def __call__(self, text):
            raise ValueError("text too strange")

    eng.intake.tokenizer = Refusing()
    with pytest.raises(RequestError) as e:
        eng.make_sequence(GenerateRequest(request_id="tok", prompt="\U0010ffff"))
    assert (e.value.status, e.value.param) == (400, "prompt") and "text too strange" in str(e.value)


def test_top_k_zero_is_off_like_minus_one(make_engine, loaded_toy):
    """Both spellings of "off" (vLLM takes both, and so does the router) sample alike."""
    eng = make_engine()
    ids = loaded_toy.tokenizer(PROMPT)["input_ids"]
    outs = [submit(eng, f"k{k}", ids, SamplingParams(max_tokens=12, temperature=1.5, top_k=k, seed=11,
                                                      ignore_eos=True)) for k in (-1, 0)]
    run_to_completion(eng)
    assert tokens_of(outs[0]) == tokens_of(outs[1])
