"""Writing one generation back to the client: a whole JSON body, or an SSE stream.

A stream starts (HTTP 200) only once a worker accepted the request, so earlier errors keep their
status. Every write to the client is bounded: the connection gets a small send buffer and each
write a timeout, so a client that stops reading is dropped within `write_timeout_s` and the
request is aborted on every worker (closing the orchestrator's events does that), instead of
holding its sequences while the buffers fill.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from tandem.contracts.protocol import REQUEST_ID_HEADER
from tandem.router.errors import RouterError, upstream_failed
from tandem.router.metrics import RouterMetrics
from tandem.router.orchestrator import (
    Finished,
    Orchestrator,
    RequestContext,
    Started,
    Tokens,
)
from tandem.router.sse import DONE, ResponseShape, frame, logprobs_body
from tandem.router.validation import Endpoint, ParsedRequest

log = logging.getLogger("tandem.router")


class ClientStalled(Exception):
    """The client stopped reading: a write did not complete within the write timeout."""


@dataclass
class Responder:
    orchestrator: Orchestrator
    metrics: RouterMetrics
    write_timeout_s: float = 5.0
    send_buffer_bytes: int = 64 * 1024  # per streaming connection; 0 keeps the OS default

    async def complete(self, parsed: ParsedRequest, shape: ResponseShape, ctx: RequestContext,
                       t0: float) -> web.Response:
        """The non-streaming answer: every token collected, then one body."""
        texts: list[str] = []
        logprobs: list[dict] = []
        first = True
        ttft = 0.0
        events = self.orchestrator.run(parsed, ctx)
        try:
            async for ev in events:
                if isinstance(ev, Tokens):
                    if first:
                        ttft = time.monotonic() - t0
                        self.metrics.ttft.observe(ttft)
                        self.metrics.vllm.ttft.labels(parsed.model).observe(ttft)
                        first = False
                    texts.append(ev.text)
                    logprobs.extend(ev.logprobs or ())
                elif isinstance(ev, Finished):
                    lp = logprobs_body(shape.endpoint, logprobs) if parsed.sampling.logprobs is not None else None
                    body = shape.full("".join(texts), ev.finish_reason, ev.prompt_tokens, ev.completion_tokens, lp)
                    self.metrics.vllm.finished(parsed.model, ev.finish_reason, ev.prompt_tokens, ev.completion_tokens,
                                               time.monotonic() - t0, None if first else ttft)
                    return web.json_response(body, headers={REQUEST_ID_HEADER: ctx.request_id})
        finally:
            await events.aclose()
        raise upstream_failed("the workers ended the request without finishing it")

    def _bound_buffers(self, request: web.Request) -> None:
        """A small kernel send buffer and transport buffer: a stalled reader blocks a write soon."""
        transport = request.transport
        if transport is None or self.send_buffer_bytes <= 0:
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer_bytes)
        transport.set_write_buffer_limits(high=self.send_buffer_bytes)

    async def _bounded(self, request: web.Request, write: Awaitable[Any]) -> None:
        """One write to the client, or ClientStalled after `write_timeout_s` (the connection is then
        cut: nothing more could reach that client anyway)."""
        try:
            async with asyncio.timeout(self.write_timeout_s):
                await write
        except TimeoutError:
            if request.transport is not None:
                request.transport.abort()
            raise ClientStalled from None

    async def stream(self, request: web.Request, parsed: ParsedRequest, shape: ResponseShape,
                     ctx: RequestContext, t0: float) -> tuple[web.StreamResponse, str]:
        """The SSE answer and its status for the metrics (499: the client left or stopped reading)."""
        resp: web.StreamResponse | None = None
        last: float | None = None
        chars = 0  # text sent so far: completions' logprobs text_offset counts from it
        ttft = 0.0
        events = self.orchestrator.run(parsed, ctx)
        try:
            async for ev in events:
                if isinstance(ev, Started) and resp is None:
                    resp = web.StreamResponse(headers={
                        "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                        REQUEST_ID_HEADER: ctx.request_id,
                    })
                    self._bound_buffers(request)
                    await self._bounded(request, resp.prepare(request))
                    if shape.endpoint is Endpoint.CHAT:
                        await self._bounded(request, resp.write(frame(shape.chunk("", role=True))))
                elif isinstance(ev, Tokens) and resp is not None:
                    now = time.monotonic()
                    gap = now - (last or t0)
                    if last is None:
                        ttft = gap
                        self.metrics.ttft.observe(gap)
                        self.metrics.vllm.ttft.labels(parsed.model).observe(gap)
                    else:
                        self.metrics.itl.observe(gap)
                        self.metrics.vllm.itl.labels(parsed.model).observe(gap)
                    last = now
                    if ev.text or ev.logprobs:
                        lp = logprobs_body(shape.endpoint, ev.logprobs, chars) if ev.logprobs else None
                        await self._bounded(request, resp.write(frame(shape.chunk(ev.text, logprobs=lp))))
                        chars += len(ev.text)
                elif isinstance(ev, Finished) and resp is not None:
                    await self._finish(request, resp, shape, ev)
                    self.metrics.e2e.observe(time.monotonic() - t0)
                    self.metrics.vllm.finished(parsed.model, ev.finish_reason, ev.prompt_tokens, ev.completion_tokens,
                                               time.monotonic() - t0, None if last is None else ttft)
                    return resp, "200"
            raise upstream_failed("the workers ended the request without finishing it")
        except (ConnectionResetError, ClientStalled) as exc:
            log.info("request %s: the client %s", ctx.request_id,
                     "stopped reading" if isinstance(exc, ClientStalled) else "went away")
            return resp or web.Response(), "499"
        except RouterError as err:
            if resp is None:
                raise
            # the stream already started: end it with an error event the client can see
            log.warning("request %s: stream failed: %s", ctx.request_id, err.message)
            await self._error_event(request, resp, err)
            return resp, "502" if err.status >= 500 else str(err.status)
        finally:
            await events.aclose()

    async def _finish(self, request: web.Request, resp: web.StreamResponse, shape: ResponseShape,
                      ev: Finished) -> None:
        final = shape.chunk(None if shape.endpoint is Endpoint.CHAT else "", ev.finish_reason)
        await self._bounded(request, resp.write(frame(final)))
        if shape.include_usage:
            await self._bounded(request, resp.write(frame(shape.usage_chunk(ev.prompt_tokens, ev.completion_tokens))))
        await self._bounded(request, resp.write(DONE))
        await self._bounded(request, resp.write_eof())

    async def _error_event(self, request: web.Request, resp: web.StreamResponse, err: RouterError) -> None:
        try:
            await self._bounded(request, resp.write(frame(err.body)))
            await self._bounded(request, resp.write(DONE))
            await self._bounded(request, resp.write_eof())
        except (ConnectionResetError, ClientStalled):
            pass
