"""The prefill side of a KV handoff and the KV endpoints: POST /internal/prefill (prompt KV computed
and leased, its first token answered), /internal/abort, /internal/kv/release, GET
/internal/kv/metadata and /internal/kv/health.

A prefill answers in one piece, so its wait is bounded below the router's prefill timeout: a
prefill still queued (not started) after `prefill_queue_s` is withdrawn and answered 429 with
Retry-After (busy: the router tries another prefill worker or prefills on the decode side); once
started it is compute, which the engine thread's health bounds (503 engine_unhealthy).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from aiohttp import web
from tandem.contracts.kv_health import KVHealth
from tandem.contracts.names import KVBackend, Role
from tandem.contracts.protocol import REQUEST_ID_HEADER, PrefillResult
from tandem.worker.engine.token_texts import TokenTexts
from tandem.worker.server.handoff import leased_source
from tandem.worker.server.parsing import request_id_body
from tandem.worker.server.responses import (
    busy_response,
    claim_request,
    error_response,
    make_sequence_off_loop,
    refused,
)
from tandem.worker.server.state import STATE_KEY, WorkerState

log = logging.getLogger("tandem.worker.server")

_POLL_S = 1.0  # how often a waiting prefill looks at its queue deadline and the engine's health


async def _first_output(state: WorkerState, outputs: Any, rid: str) -> Any:
    """The prefill's one output (leased blocks, or finished), or an error response once it waited
    `prefill_queue_s` without starting or the engine stopped making progress."""
    deadline = time.monotonic() + state.settings.prefill_queue_s
    while True:
        outs = await outputs.get(max(0.01, min(_POLL_S, deadline - time.monotonic())))
        if outs:
            return outs[0]
        if (problem := state.engine_problem()) is not None:
            return error_response(503, problem, "service_unavailable", code="engine_unhealthy", request_id=rid)
        if time.monotonic() >= deadline and state.engine.engine.withdraw(rid):
            state.metrics.refused.labels("prefill_queue_timeout").inc()
            return busy_response(429, f"the prompt waited {state.settings.prefill_queue_s:g} s in this "
                                 "prefill worker's queue without starting", "prefill_queue_timeout", rid)


async def prefill(request: web.Request) -> web.Response:
    from tandem.worker.engine.errors import RequestError

    claimed = await claim_request(request, "/internal/prefill", not_for=Role.DECODE)
    if isinstance(claimed, web.Response):
        return claimed
    state, req = claimed
    rid, aeng = req.request_id, state.engine
    if state.transport is None:
        # Nobody could pull the blocks: leasing them would only hold memory until the lease ends.
        aeng.engine.release_claim(rid)
        return error_response(400, "this worker has no KV transport (--kv-backend none), so it cannot "
                              "act as a prefill peer", param=None, code="kv_backend_mismatch", request_id=rid)
    try:
        seq = await make_sequence_off_loop(aeng.engine, req, prefill_only=True)
        outputs = aeng.submit(seq)  # takes the claim over
    except RequestError as e:
        return refused(state, e, rid)
    finally:
        aeng.engine.release_claim(rid)
    handed_out = False
    try:
        out = await _first_output(state, outputs, rid)
        if isinstance(out, web.Response):
            return out
        resp = _result(state, seq, out)
        handed_out = True
        return resp
    finally:
        if not handed_out:
            outputs.close()
            aeng.engine.release(rid)  # leased perhaps, but its token was never handed out


def _result(state: WorkerState, seq: Any, out: Any) -> web.Response:
    rid = seq.request_id
    if out.error is not None:
        return web.json_response({"error": out.error}, status=500, headers={REQUEST_ID_HEADER: rid})
    kv = None
    if out.kv_blocks is not None:
        kv = leased_source(state, rid, out.kv_blocks, seq.num_computed)
        if kv is None:
            return error_response(503, "the KV lease ended before the prefill result was sent (lease_s "
                                  "too short?): retry", "service_unavailable", code="kv_lease_expired",
                                  request_id=rid)
    result = PrefillResult(request_id=rid, prompt_token_ids=seq.prompt_ids, first_token_id=out.token_ids[0],
                           first_token_text=out.text, finish_reason=out.finish_reason, kv=kv)
    if out.logprobs:
        result.first_token_logprobs = TokenTexts.of(state.engine.engine.tokenizer).wire(out.logprobs)[0]
    log.info("prefill done", extra={"request_id": rid, "prompt_tokens": len(seq.prompt_ids),
                                     "leased_blocks": len(out.kv_blocks or [])})
    return web.json_response(result.to_dict(), headers={REQUEST_ID_HEADER: rid})


async def abort(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    rid, lease_token = await request_id_body(request, token=False)
    found = state.engine.abort(rid, lease_token) if state.engine is not None else False
    log.info("abort", extra={"request_id": rid, "found": found})
    return web.json_response({"request_id": rid, "aborted": found})


async def kv_release(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    rid, lease_token = await request_id_body(request, token=True)
    found = state.engine.engine.release_lease(rid, lease_token) if state.engine is not None else False
    log.info("KV lease released", extra={"request_id": rid, "found": found})
    return web.json_response({"request_id": rid, "released": found})


async def kv_check(request: web.Request) -> web.Response:
    """{"request_id", "lease_token", "block_ids"}: may these blocks be read? Asked by this worker's
    other tensor-parallel ranks (engine/parallel/rank_server.py), whose reads rank 0's leases cover."""
    state = request.app[STATE_KEY]
    rid, lease_token = await request_id_body(request, token=True)
    blocks = (await request.json()).get("block_ids")
    ok = (state.engine is not None and isinstance(blocks, list) and all(type(b) is int for b in blocks)
          and state.engine.engine.check_read(rid, lease_token, blocks))
    return web.json_response({"request_id": rid, "ok": ok})


async def kv_metadata(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    if state.transport is None:
        return error_response(404, "this worker has no KV transport (--kv-backend none)", "not_found",
                              code="no_kv_transport")
    return web.json_response(state.transport.metadata())


async def kv_health(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    if state.transport is None:
        return web.json_response(KVHealth(backend=KVBackend.NONE).to_dict())
    return web.json_response(state.transport.health().to_dict())
