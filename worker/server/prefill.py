"""The prefill side of a KV handoff: POST /internal/prefill (prompt KV computed and leased, its first
token answered). The lease's own endpoints (/internal/kv/*) are in kv_peer.py, abort in abort.py.

A prefill answers in one piece, so its wait is bounded below the router's prefill timeout: the
engine withdraws a prefill still queued (not started) after `prefill_queue_s`, answered 429 with
Retry-After (busy: the router tries another prefill worker or prefills on the decode side); once
started it is compute, which the engine thread's health bounds (503 engine_unhealthy).
"""

from __future__ import annotations

import logging

from aiohttp import web
from tandem.contracts.names import Role
from tandem.contracts.protocol import REQUEST_ID_HEADER, PrefillResult
from tandem.worker.engine.token_texts import TokenTexts
from tandem.worker.server.http_errors import refused
from tandem.worker.server.parsing import model_request

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
