"""This worker as a KV peer: POST /internal/kv/release (a reader is done with a lease), POST
/internal/kv/check (may a tensor-parallel rank read these blocks), GET /internal/kv/metadata (the
transport's addressing, worker/kv/pull_transport.py) and GET /internal/kv/health. The KV events feed,
/internal/kv/events, is kv_events.py."""

from __future__ import annotations

import logging

from aiohttp import web
from tandem.contracts.kv_health import KVHealth
from tandem.contracts.names import KVBackend
from tandem.worker.server.http_errors import error_response
from tandem.worker.server.parsing import request_id_body
from tandem.worker.server.state import STATE_KEY, WorkerState

log = logging.getLogger("tandem.worker.server")


async def release(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    rid, lease_token = await request_id_body(request, token=True)
    found = state.engine.release_lease(rid, lease_token) if state.engine is not None else False
    log.info("KV lease released", extra={"request_id": rid, "found": found})
    return web.json_response({"request_id": rid, "released": found})


async def check(request: web.Request) -> web.Response:
    """{"request_id", "lease_token", "block_ids"}: may these blocks be read? Asked by this worker's
    other tensor-parallel ranks (engine/parallel/rank_server.py), whose reads rank 0's leases cover."""
    state = request.app[STATE_KEY]
    rid, lease_token = await request_id_body(request, token=True)
    blocks = (await request.json()).get("block_ids")
    ok = (state.engine is not None and isinstance(blocks, list) and all(type(b) is int for b in blocks)
          and state.engine.engine.check_read(rid, lease_token, blocks))
    return web.json_response({"request_id": rid, "ok": ok})


async def metadata(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    if state.transport is None:
        return error_response(404, "this worker has no KV transport (--kv-backend none)", "not_found",
                              code="no_kv_transport")
    return web.json_response(state.transport.metadata())


def transfer_health(state: WorkerState) -> KVHealth:
    """The worker's KV transfer health: GET /internal/kv/health, and WorkerInfo.kv_health."""
    return KVHealth(backend=KVBackend.NONE) if state.transport is None else state.transport.health()


async def health(request: web.Request) -> web.Response:
    return web.json_response(transfer_health(request.app[STATE_KEY]).to_dict())
