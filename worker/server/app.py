"""The worker's aiohttp application: the internal protocol (tandem.contracts.protocol) over the engine.

Model endpoints answer 503 until the model is loaded; errors before a stream starts are OpenAI-format
4xx/5xx bodies; once streaming, a failure ends the NDJSON stream with an error event. A client that
goes away aborts its sequence, which frees its blocks. With an internal secret set, /internal/*
(but the KV health probe) answers only callers that send it (worker/server/auth.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from tandem.contracts.kv_health import KVHealth
from tandem.contracts.names import KVBackend, Role
from tandem.contracts.protocol import (
    NDJSON,
    REQUEST_ID_HEADER,
    EventType,
    GenerateRequest,
    KVSource,
    PrefillResult,
    StreamEvent,
    WorkerInfo,
    openai_error,
)
from tandem.worker.server import kv_events, tokenizer_files
from tandem.worker.server.auth import internal_auth
from tandem.worker.server.metrics import WorkerMetrics
from tandem.worker.server.parsing import RequestRefused, parse_generate, read_json, request_id_body

if TYPE_CHECKING:  # torch stays out of the import: the server starts before the model loads
    from tandem.worker.engine.async_engine import AsyncEngine
    from tandem.worker.kv.base import KVTransport

log = logging.getLogger("tandem.worker.server")


@dataclass
class WorkerSettings:
    role: Role
    advertise_url: str  # base URL peers and the router use to reach this worker
    engine_id: str  # "<pod or host>-<epoch>"
    generation: str = ""
    kv_backend: str = "none"
    served_name: str | None = None
    pull_wait_s: float = 10.0  # how long a decode waits for free blocks to receive a pulled KV
    heartbeat_s: float = 5.0  # a generate stream silent this long gets a heartbeat line (router: 15 s)
    # The service's internal secret (tandem.contracts.internal_auth); None: /internal/* is open.
    internal_secret: str | None = field(default=None, repr=False)


@dataclass
class WorkerState:
    """What the routes read; the engine and transport appear once start-up has loaded them."""

    settings: WorkerSettings
    engine: AsyncEngine | None = None
    transport: KVTransport | None = None
    ready: bool = False
    load_error: str | None = None
    started: float = field(default_factory=time.time)
    metrics: WorkerMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = WorkerMetrics(lambda: self.engine.engine if self.engine is not None else None)


STATE_KEY = web.AppKey("tandem_worker_state", WorkerState)


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, request_id: str | None = None) -> web.Response:
    headers = {REQUEST_ID_HEADER: request_id} if request_id else None
    return web.json_response(openai_error(message, type_, param, code), status=status, headers=headers)


def _from_request_error(e: Any, request_id: str | None) -> web.Response:
    return error_response(e.status, str(e), e.type, e.param, e.code, request_id)



def _need_engine(state: WorkerState, request_id: str | None = None) -> web.Response | None:
    if state.engine is None or not state.ready:
        msg = state.load_error or "the model is still loading"
        return error_response(503, msg, "service_unavailable", code="not_ready", request_id=request_id)
    return None


def _wrong_role(state: WorkerState, route: str, request_id: str | None) -> web.Response:
    return error_response(400, f"a {state.settings.role.value} worker does not serve {route}",
                          param=None, code="wrong_role", request_id=request_id)


# ---- plain endpoints --------------------------------------------------------------------------

async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    if state.ready:
        return web.json_response({"status": "ready"})
    status = "failed" if state.load_error else "loading"
    return web.json_response({"status": status, "message": state.load_error}, status=503)


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    if (resp := _need_engine(state)) is not None:
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
        generation=s.generation,
        kv_backend=s.kv_backend,
        ready=state.ready,
        running=eng.num_running if eng else 0,
        waiting=eng.num_waiting if eng else 0,
        kv_usage=eng.allocator.num_used / eng.allocator.num_blocks if eng else 0.0,
        outstanding_prompt_tokens=eng.outstanding_prompt_tokens() if eng else 0,
        tokenizer_sha256=tokenizer_files.digest(request.app),
    ).to_dict()
    if eng is not None:
        doc |= {"kv_blocks_free": eng.allocator.num_free, "kv_blocks_total": eng.allocator.num_blocks,
                "kv_blocks_cached": eng.allocator.num_cached,
                "kv_layout": eng.layout.to_dict(), "leased": len(eng.leases), "url": s.advertise_url}
    return web.json_response(doc)


# ---- generate --------------------------------------------------------------------------------

async def _reserve_blocks(state: WorkerState, seq: Any) -> Any:
    """The engine's PullReservation for seq's prompt, waiting up to pull_wait_s for room; or None."""
    eng = state.engine.engine
    deadline = time.monotonic() + state.settings.pull_wait_s
    while True:
        res = eng.reserve_for_pull(seq)
        if res is not None or time.monotonic() >= deadline:
            return res
        await asyncio.sleep(0.02)


async def _pull(state: WorkerState, req: GenerateRequest, seq: Any) -> list[int] | web.Response:
    """Allocate local blocks and pull the prompt's KV into them; an error response on failure.
    Leading blocks this worker's prefix cache already holds are taken from it, and only the rest
    is read from the prefill worker's lease (a subset of its blocks)."""
    from tandem.worker.kv.base import KVTransferError

    rid, src, eng = req.request_id, req.kv_source, state.engine.engine
    if len(seq.output_ids) != 1:
        return error_response(400, "kv_source needs the prefill worker's first token: generated_token_ids "
                              "with exactly one token id (or first_token_id)", param="generated_token_ids",
                              request_id=rid)
    if state.transport is None:
        return error_response(400, "this worker has no KV transport (--kv-backend none)", param="kv_source",
                              code="kv_backend_mismatch", request_id=rid)
    if src.backend != state.transport.name:
        return error_response(400, f"kv_source.backend is {src.backend!r}, this worker uses "
                              f"{state.transport.name!r}", param="kv_source", code="kv_backend_mismatch",
                              request_id=rid)
    expected = len(seq.prompt_ids)
    if src.num_tokens != expected or len(src.block_ids) != eng.layout.blocks_for(expected):
        return error_response(400, f"kv_source holds {src.num_tokens} tokens in {len(src.block_ids)} blocks, "
                              f"but the prompt here is {expected} tokens: prefill and decode workers "
                              "disagree on the tokenization", param="kv_source", code="kv_mismatch",
                              request_id=rid)
    res = await _reserve_blocks(state, seq)
    if res is None:
        return error_response(503, "the KV cache is full: no blocks free to receive the prompt's KV",
                              "service_unavailable", code="kv_cache_full", request_id=rid)
    held = len(res.cached)
    missing = dataclasses.replace(src, block_ids=src.block_ids[held:],
                                  num_tokens=src.num_tokens - held * eng.layout.block_size)
    t0 = time.monotonic()
    try:
        await state.transport.pull(rid, missing, res.fresh)
    except KVTransferError as e:
        eng.free_blocks(res.blocks)
        log.warning("KV pull failed: %s", e, extra={"request_id": rid, "state": str(e.state)})
        return error_response(503, f"KV transfer from {src.url} failed ({e.state}): {e}", "service_unavailable",
                              code="kv_transfer_failed", request_id=rid)
    except BaseException:
        eng.free_blocks(res.blocks)
        raise
    state.metrics.kv_pull_seconds.observe(time.monotonic() - t0)
    state.metrics.kv_pull_saved_bytes.inc(held * eng.layout.block_bytes)
    return res.blocks


def _line(ev: StreamEvent) -> bytes:
    return (json.dumps(ev.to_dict()) + "\n").encode()


async def _finished_at_replay(seq: Any) -> AsyncGenerator[Any, None]:
    """The one output of a request whose replayed tokens already end it: the text held back, if any."""
    from tandem.worker.engine.sequence import SeqOutput

    yield SeqOutput(seq.request_id, text=seq.detok.take(final=True), finished=True,
                    finish_reason=seq.finish_reason)


async def generate(request: web.Request) -> web.StreamResponse:
    """Stream a sequence as NDJSON. Tokens given in generated_token_ids (a handoff's first token, a
    resume's tokens so far) are replayed by make_sequence, never streamed: the stream starts after them."""
    from tandem.worker.engine.errors import RequestError

    state = request.app[STATE_KEY]
    body = await read_json(request)
    req = parse_generate(body, request)
    rid = req.request_id
    if state.settings.role == Role.PREFILL:
        return _wrong_role(state, "/internal/generate", rid)
    if (resp := _need_engine(state, rid)) is not None:
        return resp
    aeng = state.engine
    try:
        seq = aeng.engine.make_sequence(req)
    except RequestError as e:
        return _from_request_error(e, rid)
    if seq.finished:  # the worker that sampled the last of them died before it could say so
        return await _stream(request, state, seq, _finished_at_replay(seq), pulled=False)
    kv_blocks = None
    if req.kv_source is not None:
        pulled = await _pull(state, req, seq)
        if isinstance(pulled, web.Response):
            return pulled
        kv_blocks = pulled
    try:
        outputs = aeng.submit(seq, kv_blocks=kv_blocks)
    except RequestError as e:
        if kv_blocks is not None:
            aeng.engine.free_blocks(kv_blocks)
        return _from_request_error(e, rid)
    return await _stream(request, state, seq, outputs, pulled=kv_blocks is not None)


async def _with_heartbeats(outputs: AsyncGenerator[Any, None], every_s: float) -> AsyncGenerator[Any, None]:
    """The engine's outputs, and None whenever `every_s` passes without one: the stream's keep-alive
    while the sequence waits in the queue (the pending read survives the wait, nothing is lost)."""
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(outputs, None))
            done, _ = await asyncio.wait({pending}, timeout=every_s)
            if not done:
                yield None
                continue
            out, pending = pending.result(), None
            if out is None:
                return
            yield out
    finally:
        if pending is not None:  # the outputs generator must be idle before anyone closes it
            pending.cancel()
            await asyncio.wait({pending})


async def _stream(request: web.Request, state: WorkerState, seq: Any, outputs: AsyncGenerator[Any, None],
                  pulled: bool) -> web.StreamResponse:
    """START, a TOKEN line per output (HEARTBEAT while there is none), then FINISH (or ERROR); a stream
    cut short aborts the sequence."""
    rid = seq.request_id
    log.info("generate started", extra={"request_id": rid, "prompt_tokens": len(seq.prompt_ids),
                                         "pulled": pulled, "replayed": seq.num_resumed})
    finished = False
    try:
        resp = web.StreamResponse(headers={"Content-Type": NDJSON, REQUEST_ID_HEADER: rid})
        await resp.prepare(request)
        await resp.write(_line(StreamEvent(EventType.START, prompt_tokens=len(seq.prompt_ids))))
        async with contextlib.aclosing(_with_heartbeats(outputs, state.settings.heartbeat_s)) as lines:
            async for out in lines:
                if out is None:
                    await resp.write(_line(StreamEvent(EventType.HEARTBEAT)))
                    continue
                if out.error is not None:
                    finished = True
                    await resp.write(_line(StreamEvent(EventType.ERROR, error=out.error)))
                    break
                if out.token_ids or out.text:
                    await resp.write(_line(StreamEvent(EventType.TOKEN, token_ids=out.token_ids, text=out.text)))
                if out.finished:
                    finished = True
                    usage = {"prompt_tokens": len(seq.prompt_ids), "completion_tokens": len(seq.output_ids),
                             "total_tokens": seq.num_tokens}
                    await resp.write(_line(StreamEvent(EventType.FINISH, finish_reason=out.finish_reason,
                                                       usage=usage)))
                    log.info("generate finished", extra={"request_id": rid, "completion_tokens": len(seq.output_ids),
                                                          "finish_reason": str(out.finish_reason)})
        await resp.write_eof()
        return resp
    except (ConnectionResetError, asyncio.CancelledError):
        log.info("client went away; aborting", extra={"request_id": rid})
        raise
    finally:
        if not finished:
            state.engine.abort(rid)
        await outputs.aclose()


# ---- prefill and the KV lease ------------------------------------------------------------------

async def prefill(request: web.Request) -> web.Response:
    from tandem.worker.engine.errors import RequestError

    state = request.app[STATE_KEY]
    body = await read_json(request)
    req = parse_generate(body, request)
    rid = req.request_id
    if state.settings.role == Role.DECODE:
        return _wrong_role(state, "/internal/prefill", rid)
    if (resp := _need_engine(state, rid)) is not None:
        return resp
    if state.transport is None:
        # Nobody could pull the blocks: leasing them would only hold memory until the lease ends.
        return error_response(400, "this worker has no KV transport (--kv-backend none), so it cannot "
                              "act as a prefill peer", param=None, code="kv_backend_mismatch", request_id=rid)
    aeng = state.engine
    try:
        seq = aeng.engine.make_sequence(req, prefill_only=True)
        outputs = aeng.submit(seq)
    except RequestError as e:
        return _from_request_error(e, rid)
    done = False
    try:
        out = await anext(outputs)
        done = True
    finally:
        if not done:
            aeng.abort(rid)
            aeng.engine.release(rid)  # leased just now, but its token was never handed out
        await outputs.aclose()
    if out.error is not None:
        return web.json_response({"error": out.error}, status=500, headers={REQUEST_ID_HEADER: rid})
    kv = None
    if out.kv_blocks is not None:
        token = aeng.engine.lease_token(rid)
        if token is None:
            return error_response(503, "the KV lease ended before the prefill result was sent (lease_s "
                                  "too short?): retry", "service_unavailable", code="kv_lease_expired",
                                  request_id=rid)
        t = state.transport
        kv = KVSource(url=state.settings.advertise_url, engine_id=state.settings.engine_id, backend=t.name,
                      block_ids=out.kv_blocks, num_tokens=seq.num_computed, lease_token=token,
                      extra=t.source_extra())
    result = PrefillResult(
        request_id=rid, prompt_token_ids=seq.prompt_ids, first_token_id=out.token_ids[0],
        first_token_text=out.text,
        finish_reason=out.finish_reason, kv=kv)
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
    app.router.add_post("/internal/generate", generate)
    app.router.add_post("/internal/prefill", prefill)
    app.router.add_post("/internal/abort", abort)
    app.router.add_post("/internal/kv/release", kv_release)
    app.router.add_get("/internal/kv/metadata", kv_metadata)
    app.router.add_get("/internal/kv/health", kv_health)
    tokenizer_files.add_routes(app, state)  # GET /internal/tokenizer
    kv_events.add_routes(app, state)  # GET /internal/kv/events
    return app


def attach_engine(state: WorkerState, engine: AsyncEngine, transport: KVTransport | None = None) -> None:
    """Wire a started AsyncEngine (and transport) into the state and mark the worker ready."""
    state.engine = engine
    state.transport = transport
    engine.engine.on_step = state.metrics.observe_step
    if transport is not None:
        transport.leases = engine.engine
        state.settings.kv_backend = transport.name
    state.ready = True
