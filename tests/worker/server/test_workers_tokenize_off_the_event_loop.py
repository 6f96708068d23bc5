"""Issue 21 defect 4, worker side: a text prompt (or chat messages) is tokenized, and a grammar
built, on a thread, so the event loop that serves every other stream never waits for it; token ids
(what a router that tokenizes sends) are taken inline. Both routes: generate and prefill."""

from __future__ import annotations

import threading

import pytest
from tandem.testing.engine_helpers import ndjson_events


@pytest.mark.parametrize("route", ["/internal/generate", "/internal/prefill"])
async def test_text_prompts_are_tokenized_off_the_loop(start_worker, route):
    w = await start_worker(role="colocated", kv_backend="tcp" if route.endswith("prefill") else None)
    loop_thread = threading.current_thread()
    seen: list[threading.Thread] = []
    tokenize = w.engine.intake.tokenize

    def recording(req):
        seen.append(threading.current_thread())
        return tokenize(req)

    w.engine.intake.tokenize = recording
    bodies = [{"request_id": "text", "prompt": "Hello there " * 50},
              {"request_id": "chat", "messages": [{"role": "user", "content": "hi"}]},
              {"request_id": "ids", "prompt_token_ids": [1, 5, 9]}]
    for body in bodies:
        body["sampling"] = {"max_tokens": 2, "temperature": 0}
        resp = await w.client.post(route, json=body)
        assert resp.status == 200, await resp.text()
        if route.endswith("generate"):
            await ndjson_events(resp)
        else:
            kv = (await resp.json())["kv"]
            if kv is not None:
                await w.client.post("/internal/kv/release", json={"request_id": body["request_id"],
                                                                  "lease_token": kv["lease_token"]})
    assert seen[0] is not loop_thread and seen[1] is not loop_thread
    assert seen[2] is loop_thread  # token ids: nothing to tokenize, no thread hop
