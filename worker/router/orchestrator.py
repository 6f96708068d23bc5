"""Runs one request across workers: prefill, handoff to decode, retries, resume and abort.

It yields router-level events (Started, Tokens, Finished) and raises RouterError; the HTTP
layer (app.py) turns those into OpenAI responses. Failures are handled here:
- prefill fails before the first token: retry on another prefill worker, then fall back to
  decode-side prefill;
- a decode worker fails mid-stream: resume on another decode worker with the tokens so far
  (`generated_token_ids`), at most `max_resumes` times, else raise a 502 within seconds (connect
  and between-chunk timeouts bound every wait);
- whoever stops consuming early (client disconnect, error): `RequestContext.abort` tells every
  worker the request touched to free it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
from tandem.contracts.protocol import (
    NDJSON,
    REQUEST_ID_HEADER,
    EventType,
    FinishReason,
    GenerateRequest,
    KVSource,
    PrefillResult,
    StreamEvent,
)
from tandem.worker.router.errors import RouterError, no_worker, upstream_failed
from tandem.worker.router.metrics import RouterMetrics
from tandem.worker.router.policy import choose, choose_decode, choose_prefill, estimate_tokens
from tandem.worker.router.pool import WorkerPool
from tandem.worker.router.validation import Limits, ParsedRequest, check_prompt_tokens

log = logging.getLogger("tandem.router")


@dataclass
class Started:
    prompt_tokens: int


@dataclass
class Tokens:
    token_ids: list[int]
    text: str


@dataclass
class Finished:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


Event = Started | Tokens | Finished


@dataclass
class Timeouts:
    connect_s: float = 3.0
    prefill_s: float = 60.0  # a whole prefill call, queueing included
    chunk_s: float = 15.0  # silence allowed between two NDJSON lines of a generate stream
    abort_s: float = 2.0


@dataclass
class RequestContext:
    """One client request: its id and every worker it touched (to abort them if it ends early)."""

    request_id: str
    touched: list[str] = field(default_factory=list)
    route: str = ""
    prefill_url: str | None = None
    decode_url: str | None = None
    done: bool = False

    def touch(self, url: str) -> None:
        if url not in self.touched:
            self.touched.append(url)


@dataclass
class _Progress:
    """What one request has produced so far, across prefill, decode and resumes."""

    prompt_ids: list[int] | None = None
    prompt_tokens: int | None = None
    generated: list[int] = field(default_factory=list)
    first_text: str = ""
    finish_reason: str = "stop"


class _WorkerFailed(Exception):
    """A worker call failed for reasons of its own (not the client's): retry elsewhere."""

    def __init__(self, message: str, dead: bool) -> None:
        super().__init__(message)
        self.dead = dead  # unreachable or cut off: do not send it this request again


# 4xx codes that blame the worker pairing, not the client (a KV handoff the decode worker
# refused, a worker of the wrong role): the router retries elsewhere instead of passing them on
_WORKER_SIDE_CODES = {"kv_backend_mismatch", "kv_mismatch", "wrong_role", "duplicate_request_id", "not_ready"}


def _is_client_error(status: int, body: object) -> bool:
    if not 400 <= status < 500 or status in (408, 409, 429):
        return False
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and (
        err.get("code") in _WORKER_SIDE_CODES or err.get("param") in ("kv_source", "first_token_id")
    ):
        return False
    return True


@dataclass
class Orchestrator:
    session: aiohttp.ClientSession
    pool: WorkerPool
    metrics: RouterMetrics
    limits: Limits = field(default_factory=Limits)
    timeouts: Timeouts = field(default_factory=Timeouts)
    short_prompt_threshold: int = 0
    max_prefill_attempts: int = 2
    max_resumes: int = 2
    _background: set[asyncio.Task] = field(default_factory=set)

    # --- worker calls -------------------------------------------------------------------------

    async def _read_error(self, resp: aiohttp.ClientResponse) -> object:
        try:
            return await resp.json(content_type=None)
        except (ValueError, aiohttp.ClientError):
            return (await resp.text())[:500]

    async def _prefill(self, url: str, greq: GenerateRequest) -> PrefillResult:
        timeout = aiohttp.ClientTimeout(
            total=self.timeouts.prefill_s, connect=self.timeouts.connect_s
        )
        self.metrics.worker_requests.labels(url, "prefill").inc()
        try:
            async with self.session.post(
                url + "/internal/prefill",
                json=greq.to_dict(),
                headers={REQUEST_ID_HEADER: greq.request_id},
                timeout=timeout,
            ) as resp:
                if resp.status != 200:
                    body = await self._read_error(resp)
                    if _is_client_error(resp.status, body):
                        raise RouterError.from_body(resp.status, body)
                    raise _WorkerFailed(f"prefill on {url} returned {resp.status}: {body}", dead=False)
                return PrefillResult.from_dict(await resp.json())
        except (aiohttp.ClientError, TimeoutError, ValueError, TypeError, KeyError) as exc:
            raise _WorkerFailed(f"prefill on {url} failed: {exc!r}", dead=True) from exc

    async def _generate(self, url: str, greq: GenerateRequest) -> AsyncIterator[StreamEvent]:
        timeout = aiohttp.ClientTimeout(
            total=None, connect=self.timeouts.connect_s, sock_read=self.timeouts.chunk_s
        )
        self.metrics.worker_requests.labels(url, "decode").inc()
        try:
            async with self.session.post(
                url + "/internal/generate",
                json=greq.to_dict(),
                headers={REQUEST_ID_HEADER: greq.request_id, "Accept": NDJSON},
                timeout=timeout,
            ) as resp:
                if resp.status != 200:
                    body = await self._read_error(resp)
                    if _is_client_error(resp.status, body):
                        raise RouterError.from_body(resp.status, body)
                    raise _WorkerFailed(f"generate on {url} returned {resp.status}: {body}", dead=False)
                async for line in resp.content:
                    line = line.strip()
                    if line:
                        yield StreamEvent.from_dict(json.loads(line))
        except (aiohttp.ClientError, TimeoutError, ValueError, TypeError, KeyError) as exc:
            raise _WorkerFailed(f"generate on {url} failed: {exc!r}", dead=True) from exc

    async def _abort_one(self, url: str, request_id: str) -> None:
        try:
            async with self.session.post(
                url + "/internal/abort",
                json={"request_id": request_id},
                headers={REQUEST_ID_HEADER: request_id},
                timeout=aiohttp.ClientTimeout(total=self.timeouts.abort_s),
            ) as resp:
                await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.info("abort of %s on %s failed: %r", request_id, url, exc)

    def abort(self, ctx: RequestContext, urls: list[str] | None = None) -> None:
        """Fire-and-forget aborts: they must outlive a cancelled handler."""
        for url in ctx.touched if urls is None else urls:
            self.metrics.aborts.inc()
            task = asyncio.get_running_loop().create_task(self._abort_one(url, ctx.request_id))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def drain(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    def _failed(self, url: str, role: str, exc: _WorkerFailed) -> None:
        log.warning("%s", exc)
        self.metrics.worker_failures.labels(url, role).inc()
        if exc.dead:
            self.pool.report_failure(url, str(exc))

    # --- one request --------------------------------------------------------------------------

    def _base_request(self, req: ParsedRequest, ctx: RequestContext) -> GenerateRequest:
        return GenerateRequest(
            request_id=ctx.request_id,
            prompt=req.prompt,
            messages=req.messages,
            prompt_token_ids=req.prompt_token_ids,
            sampling=req.sampling,
        )

    async def _run_prefill(
        self, req: ParsedRequest, ctx: RequestContext, url: str, generation: str
    ) -> PrefillResult | None:
        """Prefill with retries on other prefill workers; None means: fall back to decode-side."""
        tried: set[str] = set()
        tokens_est = estimate_tokens(req.prompt_chars())
        for attempt in range(self.max_prefill_attempts):
            ctx.touch(url)
            ctx.prefill_url = url
            self.pool.assign(url, tokens_est)
            try:
                return await self._prefill(url, self._base_request(req, ctx))
            except _WorkerFailed as exc:
                self._failed(url, "prefill", exc)
                self.abort(ctx, [url])
                tried.add(url)
            finally:
                self.pool.release(url, tokens_est)
            nxt = choose_prefill(self.pool.views(), generation, frozenset(tried))
            if nxt is None:
                break
            log.info("request %s: retrying prefill on %s (attempt %d)", ctx.request_id, nxt.url, attempt + 2)
            url = nxt.url
        ctx.prefill_url = None
        return None

    async def _decode_once(
        self, url: str, greq: GenerateRequest, req: ParsedRequest, p: _Progress
    ) -> AsyncIterator[Event]:
        """One generate call; raises _WorkerFailed if it ends in anything but a finish."""
        # with a KV handoff the decode worker re-emits the prefill's first token: skip it
        skip_first = greq.kv_source is not None
        async with contextlib.aclosing(self._generate(url, greq)) as stream:
            async for ev in stream:
                if ev.type is EventType.ERROR:
                    err = ev.error or {}
                    if err.get("type") == "invalid_request_error" and not p.generated:
                        raise RouterError.from_body(400, {"error": err})
                    raise _WorkerFailed(f"decode on {url}: {err.get('message')}", dead=False)
                if ev.type is EventType.START:
                    if p.prompt_tokens is None and ev.prompt_tokens is not None:
                        p.prompt_tokens = ev.prompt_tokens
                        check_prompt_tokens(p.prompt_tokens, req, self.limits)
                        yield Started(p.prompt_tokens)
                    continue
                if skip_first and ev.token_ids:
                    skip_first = False
                    ev.token_ids = ev.token_ids[1:]
                    ev.text = ev.text[len(p.first_text):] if ev.text.startswith(p.first_text) else ev.text
                    if not ev.token_ids:
                        ev.text = ""
                if p.prompt_tokens is None:  # a worker that sent no START
                    p.prompt_tokens = (ev.usage or {}).get("prompt_tokens", 0)
                    yield Started(p.prompt_tokens)
                if ev.token_ids or ev.text:
                    p.generated.extend(ev.token_ids)
                    yield Tokens(list(ev.token_ids), ev.text)
                if ev.type is EventType.FINISH:
                    reason = ev.finish_reason or FinishReason.STOP
                    if reason in (FinishReason.ABORT, FinishReason.ERROR):
                        raise _WorkerFailed(f"decode on {url} ended with {reason}", dead=False)
                    p.finish_reason = reason.value
                    return
        raise _WorkerFailed(f"decode stream from {url} ended early", dead=True)

    async def run(self, req: ParsedRequest, ctx: RequestContext) -> AsyncIterator[Event]:
        """The events of one request. Raises RouterError for anything the client must see."""
        plan = choose(self.pool.views(), req.prompt_chars(), self.short_prompt_threshold)
        if plan is None:
            raise no_worker("no worker is ready to serve this request; retry shortly.")
        ctx.route = plan.reason
        p = _Progress(prompt_ids=req.prompt_token_ids)
        kv: KVSource | None = None

        if plan.prefill is not None:
            res = await self._run_prefill(req, ctx, plan.prefill.url, plan.prefill.generation)
            if res is None:
                ctx.route = "prefill failed"
            else:
                p.prompt_ids = res.prompt_token_ids
                p.prompt_tokens = len(res.prompt_token_ids)
                check_prompt_tokens(p.prompt_tokens, req, self.limits)
                yield Started(p.prompt_tokens)
                p.generated.append(res.first_token_id)
                p.first_text = res.first_token_text
                yield Tokens([res.first_token_id], res.first_token_text)
                if res.finish_reason is not None:
                    ctx.done = True
                    yield Finished(res.finish_reason.value, p.prompt_tokens, 1)
                    return
                kv = res.kv
        self.metrics.routes.labels(ctx.route).inc()

        decode = plan.decode
        excluded: set[str] = set()
        failures = 0
        while True:
            greq = self._base_request(req, ctx)
            if p.prompt_ids is not None:
                greq.prompt, greq.messages, greq.prompt_token_ids = None, None, p.prompt_ids
            if kv is not None:
                greq.kv_source, greq.first_token_id = kv, p.generated[0]
            else:
                greq.generated_token_ids = list(p.generated)
            ctx.touch(decode.url)
            ctx.decode_url = assigned = decode.url
            self.pool.assign(assigned)
            try:
                async for ev in self._decode_once(decode.url, greq, req, p):
                    yield ev
                ctx.done = True
                yield Finished(p.finish_reason, p.prompt_tokens or 0, len(p.generated))
                return
            except _WorkerFailed as exc:
                self._failed(decode.url, "decode", exc)
                if exc.dead:
                    self.abort(ctx, [decode.url])
                    excluded.add(decode.url)
                else:  # it may get the resume: its copy must be gone first (same request id)
                    await self._abort_one(decode.url, ctx.request_id)
                failures += 1
                if kv is not None and ctx.prefill_url is not None:
                    self.abort(ctx, [ctx.prefill_url])  # free its leased blocks now
                kv = None
                nxt = choose_decode(self.pool.views(), frozenset(excluded))
                if failures > self.max_resumes or nxt is None:
                    raise upstream_failed(
                        f"the decode worker failed and no other could resume the request: {exc}"
                    ) from exc
                self.metrics.resumes.inc()
                log.info(
                    "request %s: resuming on %s after %d tokens",
                    ctx.request_id, nxt.url, len(p.generated),
                )
                decode = nxt
            finally:
                self.pool.release(assigned)
