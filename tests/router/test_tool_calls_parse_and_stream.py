"""Tool calls: each parser finds the calls its format writes (and leaves other text as content), the
grammar for `required` / a named function makes exactly that format (a random token stream
constrained by it parses back into valid calls), streaming holds back only what may begin a call,
and the request fields are checked."""

from __future__ import annotations

import json

import pytest
from tandem.router.errors import RouterError
from tandem.router.tool_parsers import PARSERS
from tandem.router.tools import ToolStream, message, parse_tools
from tandem.router.validation import Endpoint, Limits, parse_request

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 12}}, "required": ["city"],
                                                "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
OUTPUTS = {
    "hermes": 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                   '{"name": "get_time", "parameters": {}}',
    "mistral": 'Let me look.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
               '{"name": "get_time", "arguments": {}}]',
}

@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_each_parser_finds_its_calls_and_leaves_plain_text_alone(parser):
    req = parse_tools({"tools": [WEATHER, TIME]}, parser)
    msg, called = message(OUTPUTS[parser], req)
    assert called and [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather", "get_time"]
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert msg["content"] in (None, "Let me look.")
    plain, called = message("Just words, {not json", req)
    assert not called and plain == {"role": "assistant", "content": "Just words, {not json"}

@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_streaming_sends_content_and_then_the_calls(parser):
    req = parse_tools({"tools": [WEATHER, TIME]}, parser)
    stream = ToolStream(req)
    text = OUTPUTS[parser]
    sent = "".join(stream.feed(text[i:i + 3]) for i in range(0, len(text), 3))
    rest, calls = stream.finish()
    assert (sent + rest).strip() in ("Let me look.", "")
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"] and calls[1]["index"] == 1
    plain = ToolStream(req)
    words = "No call here <tool but plain"
    assert "".join(plain.feed(c) for c in words) + plain.finish()[0] == words and not plain.finish()[1]

@pytest.mark.parametrize("parser", sorted(PARSERS))
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_the_grammar_only_admits_calls_that_parse(parser, choice):
    """Random walks through the grammar's token masks (the toy tokenizer) parse back into calls."""
    import random

    import llguidance
    import llguidance.hf
    from tandem.contracts.structured_output import validate
    from transformers import AutoTokenizer

    req = parse_tools({"tools": [WEATHER, TIME], "tool_choice": choice, "parallel_tool_calls": False}, parser)
    grammar = validate(req.grammar_spec())
    tok = AutoTokenizer.from_pretrained(_toy_dir())
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tok, n_vocab=512), grammar, log_level=0)
    rnd = random.Random(0)
    out: list[int] = []
    for _ in range(300):
        mask = matcher.compute_bitmask()
        allowed = [t for t in range(512) if mask[t // 8] >> (t % 8) & 1 and t != tok.eos_token_id]
        if matcher.is_stopped() or not allowed:
            break
        t = rnd.choice(allowed)
        assert matcher.consume_token(t)
        out.append(t)
    msg, called = message(tok.decode(out), req)
    assert called, tok.decode(out)
    names = [c["function"]["name"] for c in msg["tool_calls"]]
    assert len(names) == 1 and (choice == "required" or names == ["get_weather"])

def _toy_dir():
    import tempfile
    from pathlib import Path

    from tandem.worker.local.toy_model import make_toy_model

    return make_toy_model(Path(tempfile.gettempdir()) / "tandem-tools-toy-llama")

@pytest.mark.parametrize(("body", "param"), [
    ({"tools": "x"}, "tools"), ({"tools": [{"type": "function", "function": {}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tool_fields_are_a_400_naming_them(body, param):
    with pytest.raises(RouterError) as info:
        parse_request({"model": "m", "messages": [{"role": "user", "content": "hi"}]} | body, Endpoint.CHAT, Limits())
    assert info.value.body["error"]["param"] == param

def test_tools_reach_the_template_and_arguments_become_objects():
    req = parse_request({"model": "m", "tools": [WEATHER], "tool_choice": "required", "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"}]}, Endpoint.CHAT, Limits())
    assert req.chat_options["tools"][0]["function"]["name"] == "get_weather"
    assert req.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert req.messages[2]["tool_call_id"] == "c1" and "lark" in req.sampling.structured
