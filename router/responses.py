"""Writing one generation back to the client: a whole JSON body, or an SSE stream.

A stream starts (HTTP 200) only once a worker accepted the request, so earlier errors keep their
status. Every write to the client is bounded: the connection gets a small send buffer and each
write a timeout, so a client that stops reading is dropped within `write_timeout_s` and the
request is aborted on every worker (closing the orchestrator's events does that), instead of
holding its sequences while the buffers fill.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, NamedTuple

from aiohttp import web
from tandem.contracts.protocol import REQUEST_ID_HEADER
from tandem.router import answer_body, tools
from tandem.router.errors import RouterError, upstream_failed
from tandem.router.fan_out import choices
from tandem.router.journey import ClientRequest, Finished, Started, Tokens
from tandem.router.metrics import RouterMetrics
from tandem.router.orchestrator import Orchestrator
from tandem.router.sse import DONE, ResponseShape, frame, logprobs_body
from tandem.router.validation import Endpoint, ParsedRequest

log = logging.getLogger("tandem.router")


class Usage(NamedTuple):
    prompt: int
    completion: int  # every choice's together


class ClientStalled(Exception):
    """The client stopped reading: a write did not complete within the write timeout."""


@dataclass
class Responder:
    orchestrator: Orchestrator
    metrics: RouterMetrics
    write_timeout_s: float = 5.0
    send_buffer_bytes: int = 64 * 1024  # per streaming connection; 0 keeps the OS default

    def _first_token(self, parsed: ParsedRequest, t0: float) -> float:
        ttft = time.monotonic() - t0
        self.metrics.ttft.observe(ttft)
        self.metrics.vllm.ttft.labels(parsed.model).observe(ttft)
        return ttft

    def _finished(self, parsed: ParsedRequest, done: dict[int, Finished], t0: float, ttft: float | None) -> Usage:
        """Usage over every choice (the prompt once), and the request's vLLM-named metrics."""
        prompt = next(iter(done.values())).prompt_tokens
        completion = sum(f.completion_tokens for f in done.values())
        reason = done[0].finish_reason
        self.metrics.vllm.finished(parsed.model, reason, prompt, completion, time.monotonic() - t0, ttft)
        return Usage(prompt, completion)

    async def complete(self, parsed: ParsedRequest, shape: ResponseShape, record: ClientRequest,
                       t0: float) -> web.Response:
        """The non-streaming answer: every choice's tokens collected, then one body built off the event
        loop (answer_body.py)."""
        texts: dict[int, list[str]] = {i: [parsed.echo or ""] for i in range(parsed.n)}
        logprobs: dict[int, list[dict]] = {i: [] for i in range(parsed.n)}
        done: dict[int, Finished] = {}
        ttft: float | None = None
        async with contextlib.aclosing(choices(self.orchestrator, parsed, record)) as events:
            async for i, ev in events:
                if isinstance(ev, Tokens):
                    if ttft is None:
                        ttft = self._first_token(parsed, t0)
                    texts[i].append(ev.text)
                    logprobs[i].extend(ev.logprobs or ())
                elif isinstance(ev, Finished):
                    done[i] = ev
        if len(done) < parsed.n:
            raise upstream_failed("the workers ended the request without finishing it")
        usage = self._finished(parsed, done, t0, ttft)
        reasons = {i: f.finish_reason for i, f in done.items()}
        body = await asyncio.to_thread(answer_body.build, parsed, shape, texts, logprobs, reasons, usage)
        return web.Response(body=body, content_type="application/json", headers={REQUEST_ID_HEADER: record.request_id})

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
                     record: ClientRequest, t0: float) -> tuple[web.StreamResponse, str]:
        """The SSE answer and its status for the metrics (499: the client left or stopped reading)."""
        resp: web.StreamResponse | None = None
        last: float | None = None
        ttft: float | None = None
        done: dict[int, Finished] = {}
        calls = {i: tools.ToolStream(parsed.tools) for i in range(parsed.n)} \
            if parsed.tools is not None and parsed.tools.parses else {}
        events = choices(self.orchestrator, parsed, record)
        try:
            async for i, ev in events:
                if isinstance(ev, Started) and resp is None:
                    resp = await self._start(request, shape, record, parsed)
                elif isinstance(ev, Tokens) and resp is not None:
                    now = time.monotonic()
                    if ttft is None:
                        ttft = self._first_token(parsed, t0)
                    elif last is not None:
                        self.metrics.itl.observe(now - last)
                        self.metrics.vllm.itl.labels(parsed.model).observe(now - last)
                    last = now
                    text = calls[i].feed(ev.text) if calls else ev.text
                    if text or ev.logprobs:
                        lp = logprobs_body(shape.endpoint, ev.logprobs, ev.offset) if ev.logprobs else None
                        await self._bounded(request, resp.write(frame(shape.chunk(text, logprobs=lp, index=i))))
                elif isinstance(ev, Finished) and resp is not None:
                    done[i] = ev
                    await self._finish_choice(request, resp, shape, i, ev, calls.get(i))
            if resp is None or len(done) < parsed.n:
                raise upstream_failed("the workers ended the request without finishing it")
            await self._end(request, resp, shape, self._finished(parsed, done, t0, ttft))
            self.metrics.e2e.observe(time.monotonic() - t0)
            return resp, "200"
        except (ConnectionResetError, ClientStalled) as exc:
            log.info("request %s: the client %s", record.request_id,
                     "stopped reading" if isinstance(exc, ClientStalled) else "went away")
            return resp or web.Response(), "499"
        except RouterError as err:
            if resp is None:
                raise
            # the stream already started: end it with an error event the client can see
            log.warning("request %s: stream failed: %s", record.request_id, err.message)
            await self._error_event(request, resp, err)
            return resp, "502" if err.status >= 500 else str(err.status)
        finally:
            await events.aclose()

    async def _finish_choice(self, request: web.Request, resp: web.StreamResponse, shape: ResponseShape, i: int,
                             ev: Finished, calls: tools.ToolStream | None) -> None:
        """A choice's last chunks: content held back for a possible tool call, the calls, the finish."""
        reason = ev.finish_reason
        if calls is not None:
            rest, found = calls.finish()
            if rest or found:
                await self._bounded(request, resp.write(frame(shape.chunk(rest or None, index=i,
                                                                          tool_calls=found))))
            reason = "tool_calls" if found else reason
        final = shape.chunk(None if shape.endpoint is Endpoint.CHAT else "", reason, index=i)
        await self._bounded(request, resp.write(frame(final)))

    async def _start(self, request: web.Request, shape: ResponseShape, record: ClientRequest,
                     parsed: ParsedRequest) -> web.StreamResponse:
        """HTTP 200 and the SSE headers; chat's role chunk and the echoed text, per choice."""
        resp = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache", REQUEST_ID_HEADER: record.request_id,
        })
        self._bound_buffers(request)
        await self._bounded(request, resp.prepare(request))
        for i in range(parsed.n):
            if shape.endpoint is Endpoint.CHAT:
                await self._bounded(request, resp.write(frame(shape.chunk("", role=True, index=i))))
            if parsed.echo:
                await self._bounded(request, resp.write(frame(shape.chunk(parsed.echo, index=i))))
        return resp

    async def _end(self, request: web.Request, resp: web.StreamResponse, shape: ResponseShape, usage: Usage) -> None:
        if shape.include_usage:
            await self._bounded(request, resp.write(frame(shape.usage_chunk(usage.prompt, usage.completion))))
        await self._bounded(request, resp.write(DONE))
        await self._bounded(request, resp.write_eof())

    async def _error_event(self, request: web.Request, resp: web.StreamResponse, err: RouterError) -> None:
        try:
            await self._bounded(request, resp.write(frame(err.body)))
            await self._bounded(request, resp.write(DONE))
            await self._bounded(request, resp.write_eof())
        except (ConnectionResetError, ClientStalled):
            pass
