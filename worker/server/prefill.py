"""The prefill side of a KV handoff and the KV endpoints: POST /internal/prefill (prompt KV computed
and leased, its first token answered), /internal/abort, /internal/kv/release, GET
/internal/kv/metadata and /internal/kv/health.

A prefill answers in one piece, so its wait is bounded below the router's prefill timeout: the
engine withdraws a prefill still queued (not started) after `prefill_queue_s`, answered 429 with
Retry-After (busy: the router tries another prefill worker or prefills on the decode side); once
started it is compute, which the engine thread's health bounds (503 engine_unhealthy).
"""

from __future__ import annotations

import logging

from aiohttp import web
from tandem.contracts.kv_health import KVHealth
from tandem.contracts.names import KVBackend, Role
from tandem.contracts.protocol import REQUEST_ID_HEADER, PrefillResult
from tandem.worker.engine.token_texts import TokenTexts
from tandem.worker.server.http_errors import error_response, refused
from tandem.worker.server.parsing import model_request, request_id_body
from tandem.worker.server.state import STATE_KEY

log = logging.getLogger("tandem.worker.server")

async def prefill(request: web.Request) -> web.Response:
    """The prompt's KV computed and leased by the engine (AsyncEngine.prefill), its first token
    answered with the lease's KVSource."""
    from tandem.worker.engine.errors import RequestError

    parsed = await model_request(request, "/internal/prefill", not_for=Role.DECODE)
    if isinstance(parsed, web.Response):
        return parsed
    state, req = parsed
    rid = req.request_id
    try:
        done = await state.engine.prefill(req, state.settings.prefill_queue_s)
    except RequestError as e:
        return refused(state, e, rid)
    seq, out = done.seq, done.out
    if out.error is not None:
        return web.json_response({"error": out.error}, status=500, headers={REQUEST_ID_HEADER: rid})
    result = PrefillResult(request_id=rid, prompt_token_ids=seq.prompt_ids, first_token_id=out.token_ids[0],
                           first_token_text=out.text, finish_reason=out.finish_reason, kv=done.kv)
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
    found = state.engine.release_lease(rid, lease_token) if state.engine is not None else False
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
