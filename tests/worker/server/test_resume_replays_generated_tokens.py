"""/internal/generate with generated_token_ids and emitted_chars, as the router resumes a request whose
decode worker died: at every resume point the client's text so far plus the new stream is exactly the
undisturbed stream (nothing held back is lost, nothing is repeated, a stop string still stops), and a
request the given tokens already ended just finishes."""

from __future__ import annotations

from tandem.testing.engine_helpers import ndjson_events, stream_text, stream_tokens

PROMPT = "Café 東京: the quick brown fox"
N = 20


async def _generate(w, rid: str, **fields) -> list[dict]:
    body = {"request_id": rid, "prompt": PROMPT, **fields}
    async with w.client.post("/internal/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await ndjson_events(resp)


def _per_token(events: list[dict]) -> tuple[list[int], list[str]]:
    """Each token of an undisturbed stream and the text its line carried (one token per line)."""
    lines = [e for e in events if e["type"] == "token"]
    assert all(len(e["token_ids"]) == 1 for e in lines)
    return [e["token_ids"][0] for e in lines], [e.get("text", "") for e in lines]


async def _check_every_resume_point(w, sampling: dict) -> tuple[str, str]:
    full = await _generate(w, "full", sampling=sampling)
    ids, texts = _per_token(full)
    want, reason = "".join(texts), full[-1]["finish_reason"]
    # all of them: a stop among them ends the request at once; max_tokens reached is the router's to
    # finish (it knows max_tokens; a worker refuses a request with nothing left to generate)
    last = len(ids) + 1 if reason == "stop" else len(ids)
    for k in range(1, last):
        had = "".join(texts[:k])  # what the client got from the worker that died after token k
        events = await _generate(w, f"resume-{k}", sampling=sampling, generated_token_ids=ids[:k],
                                 emitted_chars=len(had))
        assert stream_tokens(events) == ids[k:], f"resumed after {k} tokens"
        assert had + stream_text(events) == want, f"resumed after {k} tokens"
        assert events[-1]["finish_reason"] == reason and events[-1]["usage"] == full[-1]["usage"]
    await w.wait_idle()
    return want, reason


async def test_every_resume_point_continues_the_same_text(start_worker):
    w = await start_worker(role="decode")
    text, reason = await _check_every_resume_point(w, {"max_tokens": N, "temperature": 0, "ignore_eos": True})
    assert reason == "length" and text


async def test_a_stop_string_spanning_the_resume_point_still_stops(start_worker):
    w = await start_worker(role="decode")
    free = _per_token(await _generate(w, "free", sampling={"max_tokens": N, "temperature": 0, "ignore_eos": True}))
    full = "".join(free[1])
    stop = full[len(full) // 2: len(full) // 2 + 3]  # three characters from the middle of the output
    assert len(stop) == 3
    text, reason = await _check_every_resume_point(
        w, {"max_tokens": N, "temperature": 0, "ignore_eos": True, "stop": [stop]})
    assert reason == "stop" and text == full[: full.find(stop)]


async def test_a_handoff_without_emitted_chars_assumes_what_the_stream_would_have_sent(start_worker):
    w = await start_worker(role="decode")
    sampling = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    ids, texts = _per_token(await _generate(w, "full", sampling=sampling))
    events = await _generate(w, "old-spelling", sampling=sampling, first_token_id=ids[0])
    assert stream_tokens(events) == ids[1:] and texts[0] + stream_text(events) == "".join(texts)


async def test_inconsistent_replays_are_refused_as_the_routers_fault(start_worker):
    w = await start_worker(role="decode")
    sampling = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    ids, _ = _per_token(await _generate(w, "full", sampling=sampling))
    for fields, param in [({"generated_token_ids": ids[:2], "emitted_chars": 10_000}, "emitted_chars"),
                          ({"generated_token_ids": ids[:2], "first_token_id": ids[1]}, "first_token_id"),
                          ({"generated_token_ids": [-1]}, "generated_token_ids")]:
        resp = await w.client.post("/internal/generate", json={"request_id": "bad", "prompt": PROMPT,
                                                                "sampling": sampling, **fields})
        assert resp.status == 400 and (await resp.json())["error"]["param"] == param


async def test_a_prefill_of_a_request_its_tokens_already_ended_is_refused(start_worker):
    """A prefill has no first token left to compute for a request whose carried tokens end it (the
    fuzz found it answering 500): 400, nothing held."""
    p = await start_worker(role="prefill", kv_backend="memory")
    resp = await p.client.post("/internal/prefill", json={
        "request_id": "done", "prompt": PROMPT, "generated_token_ids": [7],
        "sampling": {"max_tokens": 8, "temperature": 0, "stop_token_ids": [7]}})
    assert resp.status == 400, await resp.text()
    assert (await resp.json())["error"]["code"] == "request_already_finished"
    await p.wait_idle()
    assert p.engine.idle()
