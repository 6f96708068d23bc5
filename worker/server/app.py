"""The worker's aiohttp application: the internal protocol (tandem.contracts.protocol) over the engine.

Routes, by file: this one has the application (create_app: the table of every route), the error
middleware and the plain endpoints (/health, /ready, /v1/models, /metrics, /internal/info);
generate.py streams /internal/generate (the engine pulls a handoff's KV first); prefill.py serves
/internal/prefill; abort.py /internal/abort; kv_peer.py the /internal/kv/* lease and transport
endpoints; kv_events.py /internal/kv/events; tokenizer_files.py /internal/tokenizer. Shared: state.py (settings,
state), http_errors.py (OpenAI-format errors), parsing.py (strict bodies), auth.py (the secret).

Model endpoints answer 503 until the model is loaded; errors before a stream starts are OpenAI-format
4xx/5xx bodies; once streaming, a failure ends the NDJSON stream with an error event. A client that
goes away aborts its sequence, which frees its blocks. /health and /ready fail once the engine
thread has died or stalls (the liveness probe then restarts the pod). With an internal secret
set, /internal/* (but the KV health probe) answers only callers that send it (auth.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from tandem.contracts.protocol import REQUEST_ID_HEADER, WorkerInfo
from tandem.worker.server import abort, generate, kv_events, kv_peer, prefill, tokenizer_files
from tandem.worker.server.auth import internal_auth
from tandem.worker.server.http_errors import error_response, need_engine
from tandem.worker.server.parsing import RequestRefused
from tandem.worker.server.state import STATE_KEY, WorkerSettings, WorkerState

__all__ = ["STATE_KEY", "WorkerSettings", "WorkerState", "create_app", "error_response"]

log = logging.getLogger("tandem.worker.server")


async def health(request: web.Request) -> web.Response:
    """Alive: the process answers, and the engine thread (once started) lives and makes progress."""
    problem = request.app[STATE_KEY].engine_problem()
    if problem is not None:
        return web.json_response({"status": "unhealthy", "message": problem}, status=503)
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    problem = state.engine_problem()
    if state.ready and problem is None:
        return web.json_response({"status": "ready"})
    if problem is not None:
        return web.json_response({"status": "unhealthy", "message": problem}, status=503)
    status = "failed" if state.load_error else "loading"
    return web.json_response({"status": status, "message": state.load_error}, status=503)


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    if (resp := need_engine(state)) is not None:
        return resp
    eng = state.engine.engine
    return web.json_response({"object": "list", "data": [{
        "id": eng.served_name, "object": "model", "created": int(state.started), "owned_by": "tandem",
        "max_model_len": eng.max_model_len,
    }]})


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = generate_latest(state.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def info(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    s = state.settings
    eng = state.engine.engine if state.engine is not None else None
    doc = WorkerInfo(
        role=s.role,
        model=(eng.served_name if eng else s.served_name) or "",
        max_model_len=eng.max_model_len if eng else 0,
        engine_id=s.engine_id,
        kv_compat=s.kv_compat,
        kv_backend=s.kv_backend,
        ready=state.ready and state.engine_problem() is None,
        running=eng.num_running if eng else 0,
        waiting=eng.num_waiting if eng else 0,
        kv_usage=eng.allocator.num_used / eng.allocator.num_blocks if eng else 0.0,
        outstanding_prompt_tokens=eng.outstanding_prompt_tokens() if eng else 0,
        tokenizer_sha256=tokenizer_files.digest(request.app),
        dtype=eng.layout.dtype if eng else "",
        kv_health=kv_peer.transfer_health(state),
    ).to_dict()
    if eng is not None:
        doc |= {"kv_blocks_free": eng.allocator.num_free, "kv_blocks_total": eng.allocator.num_blocks,
                "kv_blocks_cached": eng.allocator.num_cached,
                "kv_layout": eng.layout.to_dict(), "leased": len(eng.leases), "url": s.advertise_url,
                "max_num_seqs": eng.config.max_num_seqs, "max_waiting": eng.max_waiting,
                "tensor_parallel": eng.layout.tp_size, "ranks": [dataclasses.asdict(r) for r in eng.runner.ranks]}
    return web.json_response(doc)


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Unknown routes and unexpected failures still answer in OpenAI's error format."""
    try:
        return await handler(request)
    except RequestRefused as e:
        return e.response
    except web.HTTPException as e:
        if e.content_type == "application/json":
            raise
        return error_response(e.status, e.reason or "error", "invalid_request_error" if e.status < 500
                              else "internal_error", request_id=request.headers.get(REQUEST_ID_HEADER))
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception as e:  # noqa: BLE001
        log.exception("unhandled error in %s", request.path)
        return error_response(500, f"internal error: {e}", "internal_error",
                              request_id=request.headers.get(REQUEST_ID_HEADER))


def create_app(state: WorkerState) -> web.Application:
    app = web.Application(middlewares=[_errors, internal_auth(lambda: state.settings.internal_secret)],
                          client_max_size=64 * 2**20)
    app[STATE_KEY] = state
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/internal/info", info)
    app.router.add_post("/internal/generate", generate.generate)
    app.router.add_post("/internal/prefill", prefill.prefill)
    app.router.add_post("/internal/abort", abort.abort)
    app.router.add_post("/internal/kv/release", kv_peer.release)
    app.router.add_post("/internal/kv/check", kv_peer.check)
    app.router.add_get("/internal/kv/metadata", kv_peer.metadata)
    app.router.add_get("/internal/kv/health", kv_peer.health)
    tokenizer_files.add_routes(app, state)  # GET /internal/tokenizer
    kv_events.add_routes(app, state)  # GET /internal/kv/events
    return app
