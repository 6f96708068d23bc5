"""`tandem up --runtime vllm --mode disaggregated` serves the official OpenAI client through
Tandem's router with text identical to one colocated vLLM server, completions and streamed chat
alike, and the decode server computes none of the prompts: they were prefilled on the prefill
server and moved by NIXL. Structured output and a required tool call come out whole (compact JSON,
finished by the grammar)."""

from __future__ import annotations

import json

import openai
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_completions_through_the_router_equal_colocated_vllm(vllm_servers) -> None:
    router, colocated = _client(vllm_servers.url("router")), _client(vllm_servers.url("colocated"))
    computed = vllm_servers.metric("decode", "vllm:prompt_tokens_by_source_total", source="local_compute")
    prompt = "The router sends the prompt to a prefill worker and streams tokens from a decode worker. " * 4
    kw = dict(model=vllm_servers.served, prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})

    got, want = router.completions.create(**kw), colocated.completions.create(**kw)

    assert got.choices[0].text == want.choices[0].text
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (want.usage.prompt_tokens, 24)
    assert vllm_servers.metric("decode", "vllm:prompt_tokens_by_source_total", source="local_compute") == computed


def test_streamed_chat_through_the_router_equals_colocated_vllm(vllm_servers) -> None:
    router, colocated = _client(vllm_servers.url("router")), _client(vllm_servers.url("colocated"))
    moved = vllm_servers.metric("decode", "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    kw = dict(model=vllm_servers.served, max_tokens=20, temperature=0, extra_body={"ignore_eos": True},
              messages=[{"role": "user", "content": "Once upon a time there was a little model that wanted to speak."}])

    streamed = router.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    chunks = list(streamed)
    want = colocated.chat.completions.create(**kw)

    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.choices[0].message.content
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 20 and usage.prompt_tokens == want.usage.prompt_tokens
    after = vllm_servers.metric("decode", "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    assert after - moved == want.usage.prompt_tokens


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "colour", "size"],
          "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["red", "green", "blue"]},
                         "size": {"type": "integer", "minimum": 0, "maximum": 9}}}


def test_structured_output_through_the_router_is_compact_json_equal_to_colocated_vllm(vllm_servers) -> None:
    """Tandem launches vLLM with compact JSON (contracts/vllm_serve.py STRUCTURED_OUTPUTS), as its own
    engine writes it: with free whitespace allowed the toy model filled the object with whitespace
    until max_tokens."""
    router, colocated = _client(vllm_servers.url("router")), _client(vllm_servers.url("colocated"))
    kw = dict(model=vllm_servers.served, max_tokens=60, temperature=0,
              messages=[{"role": "user", "content": "Describe the sky as JSON."}],
              response_format={"type": "json_schema", "json_schema": {"name": "sky", "schema": SCHEMA}})

    got, want = router.chat.completions.create(**kw), colocated.chat.completions.create(**kw)

    text = got.choices[0].message.content
    assert got.choices[0].finish_reason == "stop", f"not finished by the grammar: {text!r}"
    value = json.loads(text)
    assert set(value) == {"ok", "colour", "size"} and value["colour"] in ("red", "green", "blue")
    assert not any(c.isspace() for c in text), f"free whitespace in {text!r}"
    assert text == want.choices[0].message.content


def test_a_required_tool_call_through_the_router_is_a_complete_call(vllm_servers) -> None:
    router = _client(vllm_servers.url("router"))
    tool = {"type": "function", "function": {"name": "paint", "parameters": SCHEMA}}

    got = router.chat.completions.create(model=vllm_servers.served, max_tokens=80, temperature=0, tools=[tool],
                                         tool_choice="required",
                                         messages=[{"role": "user", "content": "Paint the sky."}])

    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls", f"{choice.finish_reason}: {choice.message}"
    calls = choice.message.tool_calls
    assert calls and all(c.function.name == "paint" for c in calls)
    assert all(set(json.loads(c.function.arguments)) == {"ok", "colour", "size"} for c in calls)


def test_the_router_proved_the_vllm_pairing_with_the_parity_probe(vllm_servers) -> None:
    """`tandem up --runtime vllm` runs the router's handoff parity probe, as the operator's router
    does: the prefill and decode servers are VERIFIED (a probe agreed) before their KV is trusted
    (the fixture waited for the verdict, whichever it was)."""
    report = vllm_servers.parity()
    assert report["enabled"] and {w["role"]: w["state"] for w in report["workers"]} == \
        {"prefill": "verified", "decode": "verified"}, report
    assert report["probes_total"]["match"] >= 1 and not report["probes_total"].get("mismatch")
