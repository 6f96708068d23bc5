"""50 concurrent streaming requests through the disaggregated stack all finish with the right counts."""

from __future__ import annotations

import asyncio

import openai
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


async def test_fifty_concurrent_streams(disagg_stack, model_name):
    client = openai.AsyncOpenAI(base_url=disagg_stack.url + "/v1", api_key="unused", max_retries=0, timeout=300)

    async def one(i: int) -> tuple[int, int, str]:
        max_tokens = 8 + i % 9
        stream = await client.completions.create(
            model=model_name, prompt=f"Request number {i}: the quick brown fox jumps over the lazy dog.",
            max_tokens=max_tokens, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage, finish, pieces = None, None, 0
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            pieces += 1
        assert pieces >= 2
        return max_tokens, usage.completion_tokens, finish

    results = await asyncio.gather(*(one(i) for i in range(50)))
    await client.close()
    assert len(results) == 50
    for want, got, finish in results:
        assert (got, finish) == (want, "length")
