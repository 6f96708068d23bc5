"""max_num_seqs holds for pulled sequences too: a decode worker with two seats given six handoffs at
once pulls their KV, queues them, never runs more than two, and finishes all six with exactly the
colocated tokens and text (first token from prefill, the rest from decode)."""

from __future__ import annotations

import asyncio

from tandem.testing.engine_helpers import ndjson_events, stream_text, stream_tokens

PROMPTS = [f"Request number {i}: the scheduler places pods" + " and more" * i for i in range(6)]
SAMPLING = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}


async def _colocated(c, i: int) -> list[dict]:
    async with c.client.post("/internal/generate", json={"request_id": f"c{i}", "prompt": PROMPTS[i],
                                                          "sampling": SAMPLING}) as resp:
        return await ndjson_events(resp)


async def _disaggregated(p, d, i: int) -> tuple[dict, list[dict]]:
    res = await (await p.client.post("/internal/prefill", json={"request_id": f"h{i}", "prompt": PROMPTS[i],
                                                                 "sampling": SAMPLING})).json()
    body = {"request_id": f"h{i}", "prompt": PROMPTS[i], "sampling": SAMPLING, "kv_source": res["kv"],
            "generated_token_ids": [res["first_token_id"]], "emitted_chars": len(res["first_token_text"])}
    async with d.client.post("/internal/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return res, await ndjson_events(resp)


async def test_six_handoffs_on_two_seats(start_worker):
    p = await start_worker(role="prefill", kv_backend="memory")
    d = await start_worker(role="decode", kv_backend="memory", max_num_seqs=2)
    c = await start_worker(role="colocated")
    seen: list[tuple[int, int]] = []  # (running, pulled and waiting) after every schedule
    schedule = d.engine.scheduler.schedule

    def watched():
        chunks = schedule()
        seen.append((len(d.engine.scheduler.running), len(d.engine.scheduler.ready)))
        return chunks

    d.engine.scheduler.schedule = watched
    expected = [await _colocated(c, i) for i in range(6)]
    results = await asyncio.gather(*(_disaggregated(p, d, i) for i in range(6)))
    for (res, events), want in zip(results, expected, strict=True):
        assert events[-1]["type"] == "finish" and events[-1]["finish_reason"] == "length"
        assert [res["first_token_id"]] + stream_tokens(events) == stream_tokens(want)
        assert res["first_token_text"] + stream_text(events) == stream_text(want)
        assert events[-1]["usage"] == want[-1]["usage"]
    assert max(r for r, _ in seen) == 2
    assert max(q for _, q in seen) >= 1  # some handoffs did wait for a seat, holding their KV
    assert d.engine.stats.requests_finished == {"length": 6}
    await p.wait_idle()
