"""POST /internal/abort: the router ends a request's sequence here, queued, running or leased (a
prefill's KV lease is freed with it); not a KV route, since a decode worker's streams end this way too."""

from __future__ import annotations

import logging

from aiohttp import web
from tandem.worker.server.parsing import request_id_body
from tandem.worker.server.state import STATE_KEY

log = logging.getLogger("tandem.worker.server")


async def abort(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    rid, lease_token = await request_id_body(request, token=False)
    found = state.engine.abort(rid, lease_token) if state.engine is not None else False
    log.info("abort", extra={"request_id": rid, "found": found})
    return web.json_response({"request_id": rid, "aborted": found})
