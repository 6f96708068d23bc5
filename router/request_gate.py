"""What a request passes before it is routed, the same way through the router's HTTP API and its
endpoint picker (picker.py): the API key, the body's size and JSON, and its turn at flow control
(flow_control.py), held until its answer is sent."""

from __future__ import annotations

import contextlib
import hmac
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from aiohttp import web
from tandem.contracts.json_body import BodyError, decode_json
from tandem.router.errors import RouterError
from tandem.router.flow_control import FlowController, FlowRefused, flow_of
from tandem.router.metrics import RouterMetrics


def bearer(headers: Mapping[str, str]) -> str | None:
    """The API key of `Authorization: Bearer KEY` (None without one)."""
    scheme, _, token = headers.get("Authorization", headers.get("authorization", "")).partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def check_api_key(key: str | None, headers: Mapping[str, str]) -> None:
    """401 unless the request presents `key` (no key configured: every request passes)."""
    if not key:
        return
    token = bearer(headers)
    if token is None or not hmac.compare_digest(token.encode(), key.encode()):
        raise RouterError(401, "Missing or incorrect API key: send 'Authorization: Bearer <key>'.",
                          "invalid_request_error", None, "invalid_api_key")


async def read_body(request: web.Request, limit: int) -> Any:
    """The request's JSON body: 413 past `limit` bytes (before reading it when it says its length),
    400 for a body that is not JSON."""
    too_large = RouterError(413, f"The request body is larger than this server accepts ({limit} bytes).",
                            "invalid_request_error", None, "request_too_large")
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise too_large from exc
    if len(raw) > limit:
        raise too_large
    try:
        return decode_json(raw, request.headers.get("Content-Type"))
    except BodyError as exc:
        raise RouterError(exc.status, str(exc), "invalid_request_error", exc.param, exc.code) from None


def flow_key(flow: FlowController, headers: Mapping[str, str]) -> tuple[str, int]:
    """The request's flow from its headers and API key: its place at the gate, and what the workers'
    schedulers share their prefill by (GenerateRequest.fairness_id, priority)."""
    return flow_of(headers, bearer(headers), flow.config)


@contextlib.asynccontextmanager
async def turn(flow: FlowController, metrics: RouterMetrics, key: tuple[str, int]) -> AsyncIterator[None]:
    """The request's turn at the flow control gate, held until its answer is sent (a no-op when
    flow control is off); `key` is the request's flow (fairness id, priority: `flow_key`)."""
    if not flow.config.enabled:
        yield
        return
    fairness, priority = key
    t0 = time.monotonic()
    metrics.flow_waiting.inc()
    waiting = True
    try:
        async with flow.admit(fairness, priority):
            waiting = False
            metrics.flow_waiting.dec()
            metrics.flow_wait.observe(time.monotonic() - t0)
            yield
    except FlowRefused as refused:
        metrics.flow_refused.labels(refused.reason).inc()
        raise
    finally:
        if waiting:  # refused, or gone before its turn
            metrics.flow_waiting.dec()
