"""A generate request waiting in the worker's queue keeps its stream alive: after START the worker
sends HEARTBEAT lines while the sequence waits (here behind another, with max_num_seqs 1), then its
tokens and FINISH as usual; heartbeats carry no tokens and end nothing."""

from __future__ import annotations

import json

from tandem.testing.engine_helpers import ndjson_events, stream_tokens


async def test_a_queued_request_gets_heartbeats_until_it_runs(start_worker):
    w = await start_worker(max_num_seqs=1)
    w.state.settings.heartbeat_s = 0.05
    long = {"request_id": "first", "prompt": "Hello", "sampling": {"max_tokens": 400, "temperature": 0,
                                                                    "ignore_eos": True}}
    queued = {"request_id": "queued", "prompt": "Hello", "sampling": {"max_tokens": 4, "temperature": 0,
                                                                       "ignore_eos": True}}
    async with w.client.post("/internal/generate", json=long) as first:
        assert json.loads(await first.content.readline())["type"] == "start"
        # it is running once a token comes (a slow first step may be preceded by heartbeats too)
        while (line := json.loads(await first.content.readline()))["type"] == "heartbeat":
            pass
        assert line["type"] == "token"
        async with w.client.post("/internal/generate", json=queued) as second:
            assert second.status == 200
            events = await ndjson_events(second)
        rest = await ndjson_events(first)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "start" and kinds[-1] == "finish"
    assert "heartbeat" in kinds[1:kinds.index("token")], kinds  # it waited behind "first", audibly
    assert all(set(e) == {"type"} for e in events if e["type"] == "heartbeat")
    assert len(stream_tokens(events)) == 4 and events[-1]["usage"]["completion_tokens"] == 4
    assert rest[-1]["type"] == "finish" and rest[-1]["finish_reason"] == "length"
