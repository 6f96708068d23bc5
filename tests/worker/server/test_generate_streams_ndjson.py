"""/internal/generate over real HTTP: NDJSON start, tokens, finish with usage; greedy tokens equal
transformers' generate; chat messages go through the chat template; the request id is echoed."""

from __future__ import annotations

from tandem.contracts.protocol import NDJSON, REQUEST_ID_HEADER
from tandem.testing.engine_helpers import (
    ndjson_events,
    reference_generate,
    stream_text,
    stream_tokens,
)


async def test_greedy_stream_matches_generate(start_worker, server_hf_toy, server_loaded_toy):
    w = await start_worker()
    body = {"request_id": "g1", "prompt": "The quick brown fox",
            "sampling": {"max_tokens": 12, "temperature": 0, "ignore_eos": True}}
    async with w.client.post("/internal/generate", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith(NDJSON)
        assert resp.headers[REQUEST_ID_HEADER] == "g1"
        events = await ndjson_events(resp)
    ids = server_loaded_toy.tokenizer("The quick brown fox")["input_ids"]
    assert events[0] == {"type": "start", "prompt_tokens": len(ids)}
    assert stream_tokens(events) == reference_generate(server_hf_toy, ids, 12)
    last = events[-1]
    assert last["type"] == "finish" and last["finish_reason"] == "length"
    assert last["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 12, "total_tokens": len(ids) + 12}
    assert stream_text(events) == server_loaded_toy.tokenizer.decode(stream_tokens(events), skip_special_tokens=True)


async def test_chat_messages_and_header_request_id(start_worker, server_hf_toy, server_loaded_toy):
    w = await start_worker()
    messages = [{"role": "user", "content": "hi there"}]
    body = {"messages": messages, "sampling": {"max_tokens": 6, "temperature": 0, "ignore_eos": True}}
    async with w.client.post("/internal/generate", json=body, headers={REQUEST_ID_HEADER: "hdr-1"}) as resp:
        assert resp.status == 200 and resp.headers[REQUEST_ID_HEADER] == "hdr-1"
        events = await ndjson_events(resp)
    ids = server_loaded_toy.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                          return_dict=True)["input_ids"]
    assert events[0]["prompt_tokens"] == len(ids)
    assert stream_tokens(events) == reference_generate(server_hf_toy, ids, 6)


async def test_resume_continues_after_generated_tokens(start_worker, server_hf_toy, server_loaded_toy):
    """generated_token_ids: re-prefill prompt + those tokens and continue; max_tokens counts them."""
    w = await start_worker(role="decode")
    ids = server_loaded_toy.tokenizer("Hello, world!")["input_ids"]
    ref = reference_generate(server_hf_toy, ids, 10)
    body = {"request_id": "res", "prompt_token_ids": ids, "generated_token_ids": ref[:4],
            "sampling": {"max_tokens": 10, "temperature": 0, "ignore_eos": True}}
    async with w.client.post("/internal/generate", json=body) as resp:
        events = await ndjson_events(resp)
    assert stream_tokens(events) == ref[4:]
    assert events[-1]["usage"]["completion_tokens"] == 10


async def test_concurrent_streams_each_match_generate(start_worker, server_hf_toy, server_loaded_toy):
    import asyncio

    w = await start_worker()
    prompts = ["Hello, world!", "Kubernetes schedules pods onto nodes", "a", "She sells sea shells by the sea"]

    async def one(i, p):
        body = {"request_id": f"c{i}", "prompt": p,
                "sampling": {"max_tokens": 8 + i, "temperature": 0, "ignore_eos": True}}
        async with w.client.post("/internal/generate", json=body) as resp:
            return await ndjson_events(resp)

    results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    for i, (p, events) in enumerate(zip(prompts, results, strict=True)):
        ids = server_loaded_toy.tokenizer(p)["input_ids"]
        assert stream_tokens(events) == reference_generate(server_hf_toy, ids, 8 + i)
