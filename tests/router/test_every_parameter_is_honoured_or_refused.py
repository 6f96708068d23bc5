"""Issue 20's rule: every request field is honoured or refused, never silently ignored.

The field names below were read from vLLM's request models (ChatCompletionRequest and
CompletionRequest in vllm/entrypoints/openai/, current and the releases that still had the
guided_* fields) and from issue 20's table. Each must be declared in router/openai_schema.py for
its endpoint; a refused one asking for something gets a 400 naming it; an honoured one changes
what the router sends the workers (so it is parsed, not dropped); an ignored one (no server
implements it) changes nothing. Adding a field to neither list fails here.
"""

from __future__ import annotations

import dataclasses

import pytest
from tandem.router.errors import RouterError
from tandem.router.openai_schema import FIELDS, Endpoint, Support, declared
from tandem.router.validation import Limits, parse_request

VLLM_COMMON = [
    "model", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n", "presence_penalty",
    "response_format", "seed", "stop", "stream", "stream_options", "temperature", "top_p", "user",
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "truncation_side", "prompt_logprobs",
    "allowed_token_ids", "bad_words", "add_special_tokens", "structured_outputs", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
    "guided_whitespace_pattern", "priority", "request_id", "logits_processors", "return_tokens_as_token_ids",
    "return_token_ids", "cache_salt", "kv_transfer_params", "ec_transfer_params", "vllm_xargs",
    "repetition_detection", "echo", "logprob_token_ids", "thinking_token_budget", "stream_interval",
    "mm_processor_kwargs", "return_prompt_text", "routed_experts_prompt_start",
]
VLLM_CHAT = VLLM_COMMON + [
    "messages", "top_logprobs", "max_completion_tokens", "tools", "tool_choice", "reasoning_effort",
    "include_reasoning", "parallel_tool_calls", "watermarking", "add_generation_prompt",
    "continue_final_message", "documents", "chat_template", "chat_template_kwargs", "media_io_kwargs",
    "session_id", "return_token_offsets", "return_mm_kwargs",
]
VLLM_COMPLETION = VLLM_COMMON + ["prompt", "prompt_embeds", "best_of", "suffix"]
ISSUE_TABLE = [  # issue 20's rows
    "tools", "tool_choice", "parallel_tool_calls", "response_format", "structured_outputs", "guided_json",
    "logprobs", "top_logprobs", "echo", "n", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "logit_bias", "min_p", "min_tokens", "stop_token_ids", "chat_template_kwargs", "add_generation_prompt",
    "continue_final_message", "max_tokens",
]

BASE = {Endpoint.CHAT: {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        Endpoint.COMPLETION: {"model": "m", "prompt": "hi"}}
LIMITS = Limits(max_tokens_limit=100)
# For each honoured field, a valid value that asks for something (differs from the default).
HONOURED_SAMPLES = {
    "model": "other", "messages": [{"role": "system", "content": "be brief"}], "prompt": "hello",
    "max_tokens": 7, "max_completion_tokens": 9, "temperature": 0.3, "top_p": 0.5, "seed": 11,
    "stop": ["x"], "stream": True, "stream_options": None, "presence_penalty": 0.5, "frequency_penalty": -0.5,
    "logit_bias": {"5": 3}, "logprobs": None, "top_logprobs": None, "response_format": {"type": "json_object"},
    "top_k": 4, "min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 2, "stop_token_ids": [3],
    "ignore_eos": True, "n": 3, "echo": True, "chat_template_kwargs": {"style": "brief"},
    "add_generation_prompt": False, "continue_final_message": True, "structured_outputs": {"regex": "[a-z]+"}, "guided_json": {"type": "object"},
    "guided_regex": "[0-9]+", "guided_choice": ["yes", "no"], "guided_grammar": 'start: "a" | "b"',
    "cache_salt": "tenant-a",
}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
TOOL_FIELDS = {  # (without the field, with it)
    "tools": ({}, {"tools": [TOOL]}),
    "tool_choice": ({"tools": [TOOL]}, {"tools": [TOOL], "tool_choice": "required"}),
    "parallel_tool_calls": ({"tools": [TOOL], "tool_choice": "required"},
                            {"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False}),
}
LOGPROBS = {Endpoint.CHAT: {"logprobs": True, "top_logprobs": 3}, Endpoint.COMPLETION: {"logprobs": 3}}


def _parse(body, endpoint):
    return parse_request(body, endpoint, LIMITS)


@pytest.mark.parametrize("endpoint", list(Endpoint))
def test_every_vllm_field_and_every_issue_row_is_declared(endpoint):
    names = VLLM_CHAT if endpoint is Endpoint.CHAT else VLLM_COMPLETION
    rows = [n for n in ISSUE_TABLE if n not in ("tools", "tool_choice", "parallel_tool_calls", "top_logprobs",
                                                 "chat_template_kwargs", "add_generation_prompt",
                                                 "continue_final_message")] if endpoint is Endpoint.COMPLETION \
        else ISSUE_TABLE
    missing = sorted(set(names + rows) - set(declared(endpoint)))
    assert not missing, f"declare these in router/openai_schema.py (honoured, refused or ignored): {missing}"


@pytest.mark.parametrize(("name", "endpoint"), [(n, e) for n, s in FIELDS.items() for e in sorted(s.endpoints)
                                                if s.support is Support.REFUSED])
def test_a_refused_field_that_asks_for_something_is_a_400_naming_it(name, endpoint):
    with pytest.raises(RouterError) as info:
        _parse(BASE[endpoint] | {name: {"ask": 1}}, endpoint)
    assert info.value.status == 400 and info.value.body["error"]["param"] == name
    for value in FIELDS[name].inert:  # its inert values ask for nothing and pass
        _parse(BASE[endpoint] | {name: value}, endpoint)


@pytest.mark.parametrize(("name", "endpoint"), [(n, e) for n, s in FIELDS.items() for e in sorted(s.endpoints)
                                                if s.support is Support.HONOURED])
def test_an_honoured_field_changes_what_the_workers_get(name, endpoint):
    base = BASE[endpoint] | ({"stream": True} if name == "stream_options" else {})
    if name in ("logprobs", "top_logprobs"):
        changed = base | (LOGPROBS[endpoint] if name == "logprobs" or endpoint is Endpoint.CHAT else {})
    elif name == "stream_options":
        changed = base | {"stream_options": {"include_usage": True}}
    elif name in TOOL_FIELDS:  # each changes the request only beside the tools it applies to
        base, changed = base | TOOL_FIELDS[name][0], base | TOOL_FIELDS[name][1]
    else:
        assert name in HONOURED_SAMPLES, f"give {name!r} a sample value in HONOURED_SAMPLES"
        changed = base | {name: HONOURED_SAMPLES[name]}
    assert _parse(changed, endpoint) != _parse(base, endpoint), f"{name} is declared honoured but has no effect"


@pytest.mark.parametrize(("name", "endpoint"), [(n, e) for n, s in FIELDS.items() for e in sorted(s.endpoints)
                                                if s.support is Support.IGNORED])
def test_an_ignored_field_changes_nothing(name, endpoint):
    """Only fields no server implements are ignored (each says why), and they have no effect."""
    assert FIELDS[name].why
    parsed = dataclasses.replace(_parse(BASE[endpoint] | {name: "x"}, endpoint), user=None)  # kept for logs only
    assert parsed == _parse(BASE[endpoint], endpoint)


def test_unknown_fields_are_ignored_as_vllm_does():
    body = BASE[Endpoint.CHAT] | {"some_future_field": 1}
    assert _parse(body, Endpoint.CHAT) == _parse(BASE[Endpoint.CHAT], Endpoint.CHAT)
