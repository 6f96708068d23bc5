"""The internal secret on a worker's HTTP API: /internal/* answers only the service's own processes.

The rule (which paths, which header) lives in tandem.contracts.internal_auth, shared with the
router and the operator; this is its aiohttp middleware, used by the worker and the KV test peer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web
from tandem.contracts.internal_auth import AUTH_HEADER, bearer_matches, needs_secret
from tandem.contracts.protocol import REQUEST_ID_HEADER, openai_error

log = logging.getLogger("tandem.worker.server")

UNAUTHORIZED = ("this endpoint is internal to the service: send the service's internal secret as "
                "'Authorization: Bearer <secret>'")


def internal_auth(secret: Callable[[], str | None]) -> Any:
    """Middleware: 401 in OpenAI's format for an /internal/* path (except the health probe) without
    the secret `secret()` returns; everything passes when it returns None (no secret configured)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        expected = secret()
        if expected is not None and needs_secret(request.path) and not bearer_matches(
                request.headers.get(AUTH_HEADER), expected):
            log.warning("refused %s %s without the internal secret", request.method, request.path,
                        extra={"peer": request.remote})
            headers = {"WWW-Authenticate": 'Bearer realm="tandem-internal"'}
            if request.headers.get(REQUEST_ID_HEADER):
                headers[REQUEST_ID_HEADER] = request.headers[REQUEST_ID_HEADER]
            return web.json_response(openai_error(UNAUTHORIZED, "invalid_request_error", None,
                                                  "invalid_internal_secret"), status=401, headers=headers)
        return await handler(request)

    return middleware
