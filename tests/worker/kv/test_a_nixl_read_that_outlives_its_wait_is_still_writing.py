"""A NIXL READ whose abort does not return within the pull's bound is reported as still writing
(issue 21, defect 13): the pull fails within its bound as before, and `still_writing(request_id)`
holds until the abort returns, so the engine keeps the destination blocks out of use meanwhile
(tests/worker/engine/test_a_read_that_may_still_land_keeps_its_blocks.py); a finished READ, or a
stopped one, leaves nothing behind."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading

import pytest
from tandem.testing.kv_peer import SMALL_LAYOUT, KVPeer
from tandem.worker.kv.base import KVTransferConfig, KVTransferError

pytestmark = pytest.mark.nixl


async def test_a_read_whose_abort_hangs_is_still_writing_until_the_abort_returns():
    pytest.importorskip("nixl_cu12", reason="needs the nixl package (nixl-cu12)")
    os.environ.setdefault("UCX_TLS", "tcp")
    prefill = KVPeer("nixl", SMALL_LAYOUT, f"land-p-{os.getpid()}", KVTransferConfig(backend="nixl"))
    decode = KVPeer("nixl", SMALL_LAYOUT, f"land-d-{os.getpid()}", KVTransferConfig(backend="nixl", timeout_s=1.0),
                    fill=False)
    await prefill.start()
    await decode.start()
    t = decode.transport
    abort_may_return = threading.Event()
    try:
        ok = prefill.prefill("ok", 64, seed=1)
        assert (await decode.pull("ok", ok, seed=1))["ok"] and t.still_writing("ok") is None

        release = t._release
        t._agent.watch = lambda handle: concurrent.futures.Future()  # the READ never reports its end
        t._release = lambda posted, md: (abort_may_return.wait(60), release(posted, md))[1]  # nor its abort
        src = prefill.prefill("r", 64, seed=2)
        blocks = decode.allocate(len(src.block_ids))
        with pytest.raises(KVTransferError):
            await t.pull("r", src, blocks)
        landing = t.still_writing("r")
        assert landing is not None and not landing.done(), "the READ may still land: say so"
        abort_may_return.set()
        await asyncio.wait_for(landing, 30)
        assert t.still_writing("r") is None
        decode.free_blocks(blocks)
    finally:
        abort_may_return.set()
        await decode.close()
        await prefill.close()
