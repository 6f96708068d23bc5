"""Every malformed OpenAI request becomes a 400 naming the parameter; valid ones map to SamplingParams."""

from __future__ import annotations

import pytest
from tandem.router.errors import RouterError
from tandem.router.validation import (
    Endpoint,
    Limits,
    check_model,
    check_prompt_tokens,
    parse_request,
)

LIMITS = Limits(max_tokens_limit=100, default_max_tokens=20, max_prompt_tokens=50)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMP = {"model": "m", "prompt": "hi"}


def _err(body, endpoint=Endpoint.CHAT) -> RouterError:
    with pytest.raises(RouterError) as info:
        parse_request(body, endpoint, LIMITS)
    return info.value


def test_chat_request_maps_every_sampling_parameter():
    req = parse_request(
        CHAT | {"max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": "x",
                "stream": True, "stream_options": {"include_usage": True}, "user": "u", "top_k": 5},
        Endpoint.CHAT, LIMITS,
    )
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, s.stop, s.top_k) == (7, 0.5, 0.9, 3, ["x"], 5)
    assert req.stream and req.include_usage and req.user == "u"
    assert req.messages == [{"role": "user", "content": "hi"}] and req.prompt is None


def test_max_completion_tokens_wins_and_default_applies():
    assert parse_request(CHAT | {"max_completion_tokens": 9, "max_tokens": 3}, Endpoint.CHAT, LIMITS).sampling.max_tokens == 9
    assert parse_request(CHAT, Endpoint.CHAT, LIMITS).sampling.max_tokens == 20


def test_text_content_parts_are_joined():
    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert parse_request(body, Endpoint.CHAT, LIMITS).messages[0]["content"] == "ab"


@pytest.mark.parametrize(
    ("prompt", "text", "ids"),
    [("hello", "hello", None), (["hello"], "hello", None), ([1, 2, 3], None, [1, 2, 3]), ([[4, 5]], None, [4, 5])],
)
def test_completion_prompt_forms(prompt, text, ids):
    req = parse_request({"model": "m", "prompt": prompt}, Endpoint.COMPLETION, LIMITS)
    assert (req.prompt, req.prompt_token_ids) == (text, ids)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 101}, "max_tokens"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"seed": 1.5}, "seed"),
        ({"stop": 5}, "stop"),
        ({"stop": ["a"] * 17}, "stop"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"n": 17}, "n"),
        ({"n": 0}, "n"),
        ({"tools": [{"type": "function", "function": {"name": 5}}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": 101}, "min_tokens"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}},
         "response_format"),
        ({"guided_regex": "[a-"}, "guided_regex"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
        ({"messages": [{"role": "user", "content": "x", "audio": {"id": "a"}}]}, "messages"),
        ({"user": 5}, "user"),
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"model": None}, "model"),
    ],
)
def test_bad_chat_parameters_are_400_naming_the_parameter(extra, param):
    err = _err(CHAT | extra)
    assert err.status == 400
    assert err.body["error"]["param"] == param
    assert err.body["error"]["type"] == "invalid_request_error"
    assert err.body["error"]["message"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"prompt": 5}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"), ({"logprobs": 21}, "logprobs"), ({"prompt": [2**63]}, "prompt"),
     ({"echo": "yes"}, "echo"), ({"echo": True, "logprobs": 1}, "echo"), ({"best_of": 2}, "best_of"), ({"suffix": "x"}, "suffix")],
)
def test_bad_completion_parameters_are_400(extra, param):
    err = _err(COMP | extra, Endpoint.COMPLETION)
    assert (err.status, err.body["error"]["param"]) == (400, param)


def test_body_must_be_an_object():
    assert _err([1, 2]).status == 400


def test_unknown_model_is_404_model_not_found():
    check_model("served", "served")
    with pytest.raises(RouterError) as info:
        check_model("other", "served")
    assert info.value.status == 404 and info.value.body["error"]["code"] == "model_not_found"


def test_prompt_over_the_limit_is_context_length_exceeded():
    req = parse_request(CHAT, Endpoint.CHAT, LIMITS)
    check_prompt_tokens(50, req, LIMITS)
    with pytest.raises(RouterError) as info:
        check_prompt_tokens(51, req, LIMITS)
    assert info.value.status == 400
    assert info.value.body["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("k", [-1, 0, 1, 40])
def test_top_k_off_or_positive_passes_as_the_workers_accept_it(k):
    """One rule (contracts.protocol.top_k_valid) on both sides: the router passes what a worker takes."""
    from tandem.contracts.sampling import top_k_valid

    assert parse_request(CHAT | {"top_k": k}, Endpoint.CHAT, LIMITS).sampling.top_k == k
    assert top_k_valid(k)
