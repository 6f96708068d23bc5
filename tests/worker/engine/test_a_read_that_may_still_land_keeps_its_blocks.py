"""Blocks a failed KV read may still write into are never handed to anyone else (issue 21, defect 13):
when the transport could not stop a READ within its bound (NIXL's abort has not returned), the
pull fails as usual (503 kv_transfer_failed, the request ends) but its destination blocks stay out
of use until the transport says the READ has stopped, and only then go back to the pool."""

from __future__ import annotations

import asyncio

import pytest
from tandem.contracts.kv_source import KVSource
from tandem.contracts.protocol import GenerateRequest
from tandem.testing.engine_helpers import greedy
from tandem.worker.engine import kv_pull
from tandem.worker.engine.errors import RequestError
from tandem.worker.engine.kv_pull import KVEndpoint
from tandem.worker.kv.base import KVTransferError, TransferState

PROMPT = [0] + list(range(60, 99))  # 40 tokens: three blocks of 16


class StuckRead:
    """A transport whose READ timed out and whose abort has not returned: it may still land."""

    name = "memory"

    def __init__(self, landing: asyncio.Future) -> None:
        self.landing = landing

    def source_extra(self) -> dict:
        return {}

    async def pull(self, request_id, source, local_block_ids, release=True):
        raise KVTransferError("the READ did not finish in time", TransferState.TIMED_OUT)

    def still_writing(self, request_id):
        return None if self.landing.done() else self.landing


async def _at_once(attempt, timeout_s):
    return attempt()


async def test_blocks_a_failed_read_may_still_write_stay_out_of_use_until_it_stops(make_engine):
    eng = make_engine(num_blocks=16, block_size=16)
    landing = asyncio.get_running_loop().create_future()
    endpoint = KVEndpoint(StuckRead(landing), "http://decode", "decode-1", "g1")
    src = KVSource(url="http://prefill", engine_id="prefill-1", backend="memory", block_ids=[4, 5, 6],
                   num_tokens=len(PROMPT), lease_token="t", kv_compat="g1")
    req = GenerateRequest(request_id="h", prompt_token_ids=PROMPT, sampling=greedy(4), kv_source=src,
                          generated_token_ids=[7])
    seq = eng.make_sequence(req)
    eng.claim("h")
    freed: list[int] = []
    with pytest.raises(RequestError) as e:
        await kv_pull.pull(eng, endpoint, req, seq, _at_once, lambda: freed.append(eng.allocator.num_used))
    eng.unclaim("h")
    assert (e.value.status, e.value.code) == (503, "kv_transfer_failed")
    assert "h" not in eng.seqs and seq.finished
    assert eng.allocator.num_used == 3, "the READ may still land in them: nobody else may get them"
    landing.set_result(None)
    await asyncio.sleep(0)  # the landing's callbacks run
    assert freed == [0] and eng.allocator.num_used == 0 and eng.allocator.num_free == 16
