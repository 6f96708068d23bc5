"""`tandem up --runtime vllm --mode disaggregated` serves the official OpenAI client through
Tandem's router with text identical to one colocated vLLM server, completions and streamed chat
alike, and the decode server computes none of the prompts: they were prefilled on the prefill
server and moved by NIXL."""

from __future__ import annotations

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
