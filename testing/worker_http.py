"""Driving real workers' internal API from tests: a prompt prefilled on one worker and decoded on
another (the KV handed over), generated on one, and every KV block back when they are done."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from tandem.testing.engine_helpers import ndjson_events, stream_tokens


async def disaggregated(s: aiohttp.ClientSession, p: str, d: str, rid: str, ids: list[int],
                        sampling: dict[str, Any]) -> list[int]:
    """POST /internal/prefill on P, then /internal/generate with its kv_source on D: the prefill's first
    token, then the decode stream (which never repeats it)."""
    async with s.post(f"{p}/internal/prefill", json={"request_id": rid, "prompt_token_ids": ids,
                                                     "sampling": sampling}) as r:
        res = await r.json()
        assert r.status == 200, res
    assert res["kv"]["backend"] in ("nixl", "tcp") and res["kv"]["num_tokens"] == len(ids)
    body = {"request_id": rid, "prompt_token_ids": ids, "sampling": sampling,
            "kv_source": res["kv"], "first_token_id": res["first_token_id"]}
    async with s.post(f"{d}/internal/generate", json=body) as r:
        assert r.status == 200, await r.text()
        return [res["first_token_id"]] + stream_tokens(await ndjson_events(r))


async def colocated(s: aiohttp.ClientSession, c: str, rid: str, ids: list[int], sampling: dict[str, Any]) -> list[int]:
    async with s.post(f"{c}/internal/generate", json={"request_id": rid, "prompt_token_ids": ids,
                                                      "sampling": sampling}) as r:
        assert r.status == 200, await r.text()
        return stream_tokens(await ndjson_events(r))


async def all_blocks_back(workers: list[Any], within_s: float = 10.0) -> None:
    """Every KV block free and nothing leased, on each worker (releases land asynchronously)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + within_s
    for w in workers:
        while True:
            info = await asyncio.to_thread(w.get_json, "/internal/info")
            if info["kv_blocks_free"] == info["kv_blocks_total"] and not info["leased"]:
                break
            assert loop.time() < end, f"{w.name}: blocks not returned: {info}"
            await asyncio.sleep(0.05)
