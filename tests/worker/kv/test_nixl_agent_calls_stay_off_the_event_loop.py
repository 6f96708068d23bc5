"""NIXL: every agent call runs on the transport's agent thread, so one that blocks (here: adding a
remote agent, as UCX does towards a peer that does not answer) leaves the event loop serving and
fails the pull within its bound; and a completion that quotes a wrong lease token frees nothing
(what a token can and cannot guard over one-sided READs is in worker/kv/README.md)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import aiohttp
import pytest
from tandem.testing.kv_peer import SMALL_LAYOUT, prefill_and_decode
from tandem.worker.kv.base import TransferState

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(120)]
pytest.importorskip("tandem.worker.kv.nixl", reason="needs the nixl package (nixl-cu12, installed by `make venv`)")

SECRET = "nixl-guard-test-secret-0123456789"
backend = "nixl"


class _Recorder:
    """Wraps the real agent: notes the thread of every call; add_remote_agent can be held."""

    def __init__(self, agent):
        self._agent = agent
        self.threads: dict[str, set[str]] = {}
        self.hold = threading.Event()
        self.held = threading.Event()
        self.hold.set()

    def __getattr__(self, name):
        target = getattr(self._agent, name)
        if not callable(target):
            return target

        def call(*args, **kw):
            self.threads.setdefault(name, set()).add(threading.current_thread().name)
            if name == "add_remote_agent" and not self.hold.is_set():
                self.held.set()
                self.hold.wait(30)
            return target(*args, **kw)

        return call


async def test_a_blocking_agent_call_leaves_the_loop_serving(peer_process: list) -> None:
    prefill, decode = await prefill_and_decode(backend, SMALL_LAYOUT, "nx-1", peer_process, secret=SECRET,
                                               timeout_s=2.0)
    t = decode.transport
    rec: _Recorder | None = None

    def wrap() -> None:
        nonlocal rec
        rec = _Recorder(t._agent.agent)
        t._agent.agent = rec

    await t._call("wrap the agent", wrap)
    assert rec is not None
    try:
        rec.hold.clear()
        pull = asyncio.create_task(decode.pull("r1", await prefill.prefill("r1", 64, seed=1), seed=1))
        assert await asyncio.to_thread(rec.held.wait, 10), "the pull never reached add_remote_agent"
        async with aiohttp.ClientSession() as s, s.get(decode.url + "/internal/kv/health") as r:
            assert r.status == 200
            served_while_held = not rec.hold.is_set()
        assert served_while_held, "the event loop waited for the blocked NIXL call"
        res = await asyncio.wait_for(pull, 10)
        assert not res["ok"] and res["state"] == TransferState.TIMED_OUT, res
        rec.hold.set()  # the agent thread comes back; the next pull goes through
        res = await decode.pull("r2", await prefill.prefill("r2", 300, seed=2), seed=2)
        assert res["ok"] and res["identical"], res
        await decode.transport._drop_peer(prefill.url)  # remove_remote_agent, on the thread too
    finally:
        rec.hold.set()
        await decode.close()
    called = set(rec.threads)
    assert {"add_remote_agent", "initialize_xfer", "get_new_notifs", "remove_remote_agent"} <= called, called
    on = {n for names in rec.threads.values() for n in names}
    assert on == {f"tandem-nixl-{t.engine_id}"}, rec.threads


async def test_a_completion_with_a_wrong_token_frees_nothing(peer_process: list) -> None:
    prefill, decode = await prefill_and_decode(backend, SMALL_LAYOUT, "nx-2", peer_process, secret=SECRET)
    try:
        src = await prefill.prefill("r", 100, seed=3)
        # A one-sided READ is not checked per block: the bytes arrive. Its completion cannot free.
        res = await decode.pull("r", dataclasses.replace(src, lease_token="not-the-token"), seed=3)
        assert res["ok"], res
        deadline = time.monotonic() + 10
        while (await prefill.health())["failures_total"].get("serve", 0) < 1:
            assert time.monotonic() < deadline, "the completion never reached the prefill side"
            await asyncio.sleep(0.05)
        blocks = await prefill.blocks()
        assert blocks["leased"] == 1 and blocks["released"] == 0
        res = await decode.pull("r", src, seed=3)
        assert res["ok"] and res["identical"], res
        while (await prefill.blocks())["leased"]:
            assert time.monotonic() < deadline + 10, "the right token's completion freed nothing"
            await asyncio.sleep(0.05)
    finally:
        await decode.close()
