"""The worker's error answers, all in OpenAI's format, and the checks every model route makes first
(an engine that is up and not draining, a route its role serves)."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from tandem.contracts import timing
from tandem.contracts.protocol import REQUEST_ID_HEADER, openai_error
from tandem.worker.server.state import WorkerState


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, request_id: str | None = None,
                   retry_after_s: float | None = None) -> web.Response:
    headers = {REQUEST_ID_HEADER: request_id} if request_id else {}
    if retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(retry_after_s)))
    return web.json_response(openai_error(message, type_, param, code), status=status, headers=headers or None)


def busy_response(status: int, message: str, code: str, request_id: str | None) -> web.Response:
    """429/503 with Retry-After: alive but full, so the router tries another worker or waits."""
    return error_response(status, message, "service_unavailable", code=code, request_id=request_id,
                          retry_after_s=timing.WORKER_RETRY_AFTER_S)


def from_request_error(e: Any, request_id: str | None) -> web.Response:
    """The engine's RequestError, 1:1 (with Retry-After when it is a temporary refusal)."""
    return error_response(e.status, str(e), e.type, e.param, e.code, request_id, e.retry_after_s)


def need_engine(state: WorkerState, request_id: str | None = None) -> web.Response | None:
    """503 until the model is loaded, and once its engine thread died or stalls; 503 with
    Retry-After while it drains (the router then sends the request, and its KV lease, elsewhere)."""
    if state.draining:
        return busy_response(503, "this worker is shutting down: send the request to another one",
                             "draining", request_id)
    if state.engine is None or not state.ready:
        msg = state.load_error or "the model is still loading"
        return error_response(503, msg, "service_unavailable", code="not_ready", request_id=request_id)
    if (problem := state.engine_problem()) is not None:
        return error_response(503, problem, "service_unavailable", code="engine_unhealthy", request_id=request_id)
    return None


def wrong_role(state: WorkerState, route: str, request_id: str | None) -> web.Response:
    return error_response(400, f"a {state.settings.role.value} worker does not serve {route}",
                          param=None, code="wrong_role", request_id=request_id)


def refused(state: WorkerState, e: Any, request_id: str) -> web.Response:
    """The engine's refusal as an answer; a full worker's is counted by reason."""
    if e.retry_after_s is not None:
        state.metrics.refused.labels(e.code).inc()
    return from_request_error(e, request_id)
