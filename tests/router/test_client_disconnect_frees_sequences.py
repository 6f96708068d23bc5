"""A client that goes away mid-request leaves nothing running or leased on any worker."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import aiohttp
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def _busy(stack) -> list[tuple[str, int, int]]:
    out = []
    for w in stack.workers():
        i = stack.info(w["url"])
        if i["running"] or i["waiting"] or i.get("leased"):
            out.append((w["name"], i["running"] + i["waiting"], i.get("leased", 0)))
    return out


def _aborts(stack) -> float:
    line = next(ln for ln in _get(stack.url + "/metrics").splitlines() if ln.startswith("tandem_router_aborts_total"))
    return float(line.split()[-1])


def _wait(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# long enough (1500 tokens) that it is still running when the client leaves
BODY = {"prompt": "The router streams tokens from a decode worker. " * 4, "max_tokens": 1500,
        "ignore_eos": True, "temperature": 0}


async def test_streaming_client_disconnect_aborts_on_workers(disagg_stack, model_name):
    aborts = _aborts(disagg_stack)
    async with aiohttp.ClientSession() as s:
        resp = await s.post(disagg_stack.url + "/v1/completions", json=BODY | {"model": model_name, "stream": True})
        assert resp.status == 200
        for _ in range(5):
            assert await resp.content.readline()
        assert _busy(disagg_stack), "the request should be running on the decode worker"
        resp.close()  # drop the connection mid-stream
    assert _wait(lambda: not _busy(disagg_stack), 5.0), f"still busy: {_busy(disagg_stack)}"
    assert _aborts(disagg_stack) > aborts


async def test_non_streaming_client_disconnect_aborts_on_workers(disagg_stack, model_name):
    aborts = _aborts(disagg_stack)

    async def call() -> None:
        async with aiohttp.ClientSession() as s, s.post(
            disagg_stack.url + "/v1/completions", json=BODY | {"model": model_name}
        ) as resp:
            await resp.read()

    task = asyncio.create_task(call())
    deadline = time.monotonic() + 10
    while not _busy(disagg_stack):
        assert time.monotonic() < deadline and not task.done(), "the request never showed up on a worker"
        await asyncio.sleep(0.05)
    task.cancel()  # the client gives up: its connection closes
    with pytest.raises(asyncio.CancelledError):
        await task
    assert _wait(lambda: not _busy(disagg_stack), 5.0), f"still busy: {_busy(disagg_stack)}"
    assert _aborts(disagg_stack) > aborts
