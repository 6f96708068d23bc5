"""The request state machine: one request across workers (plan, prefill, handoff, decode, retry,
resume, abort).

A prompt whose token ids are known (the router tokenized it, or the client sent ids) is checked
against `maxPromptTokens` before the plan, so no worker computes for a prompt that is refused.
The policy (policies/) chooses workers; every call to a worker goes through a `WorkerClient`
(worker_client.py), so this module does no I/O of its own and is tested against an in-process
fake. It yields router-level events (Started, Tokens, Finished) and raises RouterError; app.py
turns those into OpenAI responses. Faults:
- prefill fails before the first token: retry on another prefill worker the policy picks
  (`max_prefill_attempts` in all), then fall back to decode-side prefill (route `prefill_failed`);
- a decode worker fails (dies mid-stream, ends its stream without a finish, refuses the
  handoff): resume on a worker the policy picks, at most `max_resumes` times, else a 502;
- a worker is busy (429, or 503 with Retry-After): it is not failed. Prefill goes to another
  prefill worker, then decode-side prefill (route `prefill_saturated`); decode goes to another
  decode worker with the same KV lease; when every one is busy the client gets a 503 with
  Retry-After if it has nothing yet, else the router waits for the soonest Retry-After (at most
  `busy_wait_s` in all) and tries again;
- a decode worker shuts down (SIGTERM: a scale-down, a rollout) and ends the stream with MIGRATE:
  the request moves to another ready decode worker of the same generation, which pulls the KV
  the leaving worker leased (prompt and generated tokens but the last) and continues the stream;
  without that KV (none yet, none of the same generation, or the pull fails) it is resumed by
  recompute. Not a failure: it counts neither against `max_resumes` nor the worker's health;
  `tandem_router_migrations_total{outcome}` and the migration time (MIGRATE to the next token)
  are measured;
- the consumer stops early (client gone, an error): every worker the request touched is told
  to abort it, so nothing stays allocated.
Handoff and resume are one mechanism: the next worker gets the tokens generated so far and how
many characters of text the client has; it replays them and streams only what follows (see
GenerateRequest.generated_token_ids), so the client gets every character exactly once and
nothing here trims text.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tandem.contracts.protocol import (
    EventType,
    FinishReason,
    GenerateRequest,
    KVSource,
    PrefillResult,
    StreamEvent,
)
from tandem.contracts.routing import RouteReason
from tandem.router.errors import RouterError, no_worker, overloaded, upstream_failed
from tandem.router.metrics import RouterMetrics
from tandem.router.policies.base import (
    Plan,
    RequestInfo,
    RoutingPolicy,
    WorkerView,
    estimate_tokens,
)
from tandem.router.pool import WorkerPool
from tandem.router.validation import Limits, ParsedRequest, check_prompt_tokens
from tandem.router.worker_client import WorkerBusy, WorkerClient, WorkerFailed

log = logging.getLogger("tandem.router")


@dataclass
class Started:
    prompt_tokens: int


@dataclass
class Tokens:
    token_ids: list[int]
    text: str
    logprobs: list[dict] | None = None  # per token (TokenLogprobs.to_wire), when the request asked


@dataclass
class Finished:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


Event = Started | Tokens | Finished


class Phase(enum.StrEnum):
    """Where a request is; logged when it ends, so an early end says where it happened."""

    PLAN = "plan"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"  # the client got a finish: nothing to abort
    FAILED = "failed"  # ended with an error the client sees


@dataclass
class RequestContext:
    """One client request: its id, where it is, and every worker it touched (to abort them)."""

    request_id: str
    touched: list[str] = field(default_factory=list)
    phase: Phase = Phase.PLAN
    route: RouteReason | None = None
    prefill_url: str | None = None
    decode_url: str | None = None
    lease_tokens: dict[str, str] = field(default_factory=dict)  # prefill url -> its KV lease's token

    @property
    def done(self) -> bool:
        return self.phase is Phase.FINISHED

    def touch(self, url: str) -> None:
        if url not in self.touched:
            self.touched.append(url)


@dataclass
class _Progress:
    """What one request has produced so far, across prefill, decode and resumes."""

    prompt_ids: list[int] | None = None
    prompt_tokens: int | None = None
    generated: list[int] = field(default_factory=list)
    chars: int = 0  # characters of generated text the client has
    finish_reason: str = FinishReason.STOP.value


@dataclass
class _Busy:
    """Decode workers that said they are full during one request, and how long they asked to wait."""

    retry_after: dict[str, float] = field(default_factory=dict)
    deadline: float | None = None  # monotonic end of the waiting allowed to this request


class _Migrating(Exception):
    """The decode worker ended the stream with MIGRATE: it is leaving (the event says what to pull)."""

    def __init__(self, event: StreamEvent) -> None:
        super().__init__("the decode worker is shutting down and migrates the sequence")
        self.event = event


@dataclass
class _Move:
    """A migration under way: of which request, from which worker, since when (until the next
    worker's first token)."""

    request_id: str
    source: str
    since: float = field(default_factory=time.monotonic)


def request_info(req: ParsedRequest, request_id: str) -> RequestInfo:
    """What the policy sees of a request: its size (exact for token ids, else estimated)."""
    if req.prompt_token_ids is not None:
        return RequestInfo(request_id, len(req.prompt_token_ids), list(req.prompt_token_ids))
    return RequestInfo(request_id, estimate_tokens(req.prompt_chars()))


@dataclass
class Orchestrator:
    client: WorkerClient
    pool: WorkerPool
    policy: RoutingPolicy
    metrics: RouterMetrics
    limits: Limits = field(default_factory=Limits)
    max_prefill_attempts: int = 2
    max_resumes: int = 2
    busy_wait_s: float = 10.0  # waiting for a busy decode worker once the client has tokens
    _background: set[asyncio.Task] = field(default_factory=set)

    # --- aborts and failures ------------------------------------------------------------------

    def abort(self, ctx: RequestContext, urls: list[str] | None = None) -> None:
        """Fire-and-forget aborts: they must outlive a cancelled handler."""
        for url in ctx.touched if urls is None else urls:
            self.metrics.aborts.inc()
            task = asyncio.get_running_loop().create_task(
                self.client.abort(url, ctx.request_id, ctx.lease_tokens.get(url)))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def drain(self) -> None:
        """Wait for the aborts still on their way (at shutdown, and in tests)."""
        while self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    def _failed(self, url: str, role: str, exc: WorkerFailed) -> None:
        log.warning("%s", exc)
        if isinstance(exc, WorkerBusy):
            self.metrics.worker_busy.labels(role).inc()
            return
        self.metrics.worker_failures.labels(role).inc()
        if exc.dead:
            self.pool.report_failure(url, str(exc))

    # --- one request --------------------------------------------------------------------------

    def _count_prefix(self, info: RequestInfo, plan: Plan) -> None:
        if info.prompt_token_ids is None:
            return
        self.metrics.routed_prompt_tokens.inc(info.prompt_tokens)
        if plan.prefill is not None:
            self.metrics.prefix_cached_tokens.labels("prefill").inc(plan.cached_prefill_tokens)
        self.metrics.prefix_cached_tokens.labels("decode").inc(plan.cached_decode_tokens)

    async def run(self, req: ParsedRequest, ctx: RequestContext) -> AsyncIterator[Event]:
        """The events of one request. Raises RouterError for anything the client must see."""
        try:
            info = request_info(req, ctx.request_id)
            if info.prompt_token_ids is not None:  # exact already: refused before any worker computes
                check_prompt_tokens(info.prompt_tokens, req, self.limits)
            plan = self.policy.plan(info, self.pool.views())
            if plan is None:
                raise no_worker("no worker is ready to serve this request; retry shortly.")
            ctx.route = plan.reason
            self._count_prefix(info, plan)
            p = _Progress(prompt_ids=req.prompt_token_ids)
            res: PrefillResult | None = None
            if plan.prefill is not None:
                ctx.phase = Phase.PREFILL
                res = await self._prefill(req, info, ctx, plan)
            self.metrics.routes.labels(ctx.route).inc()
            if res is not None:
                p.prompt_ids, p.prompt_tokens = res.prompt_token_ids, len(res.prompt_token_ids)
                check_prompt_tokens(p.prompt_tokens, req, self.limits)
                yield Started(p.prompt_tokens)
                p.generated.append(res.first_token_id)
                p.chars += len(res.first_token_text)
                first_lp = [res.first_token_logprobs] if res.first_token_logprobs else None
                yield Tokens([res.first_token_id], res.first_token_text, first_lp)
                if res.finish_reason is not None:
                    ctx.phase = Phase.FINISHED
                    yield Finished(res.finish_reason.value, p.prompt_tokens, 1)
                    return
            ctx.phase = Phase.DECODE
            async for ev in self._decode(req, info, ctx, plan.decode, p, res.kv if res else None):
                yield ev
        except RouterError:
            ctx.phase = Phase.FAILED
            raise
        finally:
            if not ctx.done:
                self.abort(ctx)

    def _request(
        self, req: ParsedRequest, ctx: RequestContext, p: _Progress | None = None, kv: KVSource | None = None,
        migrated_from: str | None = None,
    ) -> GenerateRequest:
        """The worker request: the client's prompt, or its token ids once a worker tokenized it, plus
        (for decode) the tokens so far, the text the client has, and where their KV is."""
        greq = GenerateRequest(
            request_id=ctx.request_id, prompt=req.prompt, messages=req.messages,
            prompt_token_ids=req.prompt_token_ids, sampling=req.sampling,
            chat_options=req.chat_options if req.messages is not None else None,
        )
        if p is not None:
            if p.prompt_ids is not None:
                greq.prompt, greq.messages, greq.prompt_token_ids = None, None, p.prompt_ids
            greq.generated_token_ids, greq.emitted_chars, greq.kv_source = list(p.generated), p.chars, kv
            greq.migrated_from = migrated_from if kv is not None else None
        return greq

    async def _prefill(
        self, req: ParsedRequest, info: RequestInfo, ctx: RequestContext, plan: Plan
    ) -> PrefillResult | None:
        """Prefill with retries on other prefill workers; None means: fall back to decode-side (the
        route says whether the prefill pool failed or was full)."""
        tried: set[str] = set()
        target: WorkerView | None = plan.prefill
        for attempt in range(self.max_prefill_attempts):
            if target is None:
                break
            url = target.url
            if attempt:
                log.info("request %s: retrying prefill on %s (attempt %d)", ctx.request_id, url, attempt + 1)
            ctx.touch(url)
            ctx.prefill_url = url
            work = info.prompt_tokens - (plan.cached_prefill_tokens if target is plan.prefill else 0)
            self.pool.assign(url, work)
            self.metrics.worker_requests.labels("prefill").inc()
            try:
                res = await self.client.prefill(url, self._request(req, ctx))
                ctx.route = plan.reason
                if res.kv is not None:  # freeing that lease early (an abort) needs its token
                    ctx.lease_tokens[url] = res.kv.lease_token
                return res
            except WorkerFailed as exc:
                self._failed(url, "prefill", exc)
                busy = isinstance(exc, WorkerBusy)
                ctx.route = RouteReason.PREFILL_SATURATED if busy else RouteReason.PREFILL_FAILED
                if not busy:  # a busy worker refused it: nothing there to abort
                    self.abort(ctx, [url])
                tried.add(url)
            finally:
                self.pool.release(url, work)
            target = self.policy.retry_prefill(info, plan, self.pool.views(), frozenset(tried))
        ctx.prefill_url = None
        return None

    async def _decode(
        self, req: ParsedRequest, info: RequestInfo, ctx: RequestContext, target: WorkerView,
        p: _Progress, kv: KVSource | None,
    ) -> AsyncIterator[Event]:
        """Decode on `target`, resuming elsewhere after each failure until a finish or a 502; busy
        workers are skipped (see `_after_busy`) without counting as failures; a worker that leaves
        hands the request on (`_migrate`)."""
        excluded: set[str] = set()
        busy = _Busy()
        failures = 0
        holder = ctx.prefill_url if kv is not None else None  # the worker whose lease `kv` is
        move: _Move | None = None
        try:
            while True:
                url = target.url
                ctx.touch(url)
                ctx.decode_url = url
                # a decode-side prefill: the prompt waits there until its first token (load-aware routing)
                pending = info.prompt_tokens if kv is None and not p.generated else 0
                self.pool.assign(url, pending)
                self.metrics.worker_requests.labels("decode").inc()
                greq = self._request(req, ctx, p, kv, holder if move is not None else None)
                try:
                    async for ev in self._stream(url, greq, req, p):
                        if pending and isinstance(ev, Tokens):
                            self.pool.prefilled(url, pending)
                            pending = 0
                        if move is not None and isinstance(ev, Tokens):
                            self._moved(move, "kv" if kv is not None else "recompute")
                            move = None
                        yield ev
                    break
                except _Migrating as m:
                    move = move or _Move(ctx.request_id, url)
                    excluded.add(url)  # never back to the worker that is leaving
                    target, kv, holder = self._migrate(info, ctx, p, url, target.generation, m.event, excluded)
                except WorkerBusy as exc:  # it refused before streaming: the KV lease is still there
                    self._failed(url, "decode", exc)
                    busy.retry_after[url] = exc.retry_after_s
                    target = await self._after_busy(info, ctx, p, excluded, busy)
                except WorkerFailed as exc:
                    failures += 1
                    nxt = await self._after_failure(req, info, ctx, p, url, exc, failures, excluded,
                                                    holder if kv is not None else None)
                    kv = holder = None
                    if nxt is None:  # it died between its last token (its text final) and its finish line
                        p.finish_reason = FinishReason.LENGTH.value
                        break
                    target = nxt
                finally:
                    self.pool.release(url, pending)
        except BaseException:
            if move is not None:
                self._moved(move, "failed")
            raise
        if move is not None:  # the next worker finished without a token of its own
            self._moved(move, "kv" if kv is not None else "recompute")
        ctx.phase = Phase.FINISHED
        yield Finished(p.finish_reason, p.prompt_tokens or 0, len(p.generated))

    async def _after_failure(
        self, req: ParsedRequest, info: RequestInfo, ctx: RequestContext, p: _Progress, url: str,
        exc: WorkerFailed, failures: int, excluded: set[str], lease_holder: str | None,
    ) -> WorkerView | None:
        """After decode on `url` failed: its copy of the request gone (a dead worker excluded), the
        lease a handoff did not pull freed, and the worker to resume on; None when every token was
        generated already. Too many failures, or no worker left, is a 502."""
        self._failed(url, "decode", exc)
        if exc.dead:
            self.abort(ctx, [url])
            excluded.add(url)
        else:  # it may get the resume: its copy (same request id) must be gone first
            self.metrics.aborts.inc()
            await self.client.abort(url, ctx.request_id, ctx.lease_tokens.get(url))
        if lease_holder is not None:
            self.abort(ctx, [lease_holder])
        if len(p.generated) >= req.sampling.max_tokens:
            return None
        nxt = self.policy.resume_decode(info, self.pool.views(), frozenset(excluded))
        if failures > self.max_resumes or nxt is None:
            log.warning("request %s: giving up after %d decode failures: %s", ctx.request_id, failures, exc)
            raise upstream_failed("the decode worker failed and no other could resume the request") from exc
        self.metrics.resumes.inc()
        log.info("request %s: resuming on %s after %d tokens", ctx.request_id, nxt.url, len(p.generated))
        return nxt

    def _migrate(
        self, info: RequestInfo, ctx: RequestContext, p: _Progress, source: str, generation: str,
        ev: StreamEvent, excluded: set[str],
    ) -> tuple[WorkerView, KVSource | None, str | None]:
        """Where a request goes when its decode worker leaves: another ready decode worker of the
        same generation with the KV it leased, else any decode-capable one by recompute; (worker,
        KV, the worker holding its lease). No worker left is a 502 (the stream has started)."""
        kv = ev.kv
        if kv is not None:
            ctx.lease_tokens[source] = kv.lease_token  # an abort there (the request ends early) frees it
            if ev.generated_token_ids != p.generated:
                log.warning("request %s: MIGRATE from %s lists %d tokens, the client has %d: recomputing",
                            ctx.request_id, source, len(ev.generated_token_ids), len(p.generated))
                kv = None
        views = self.pool.views()
        exclude = frozenset(excluded | {source})
        nxt = None
        if kv is not None:
            same = [v for v in views if v.generation == generation]
            nxt = self.policy.resume_decode(info, same, exclude)
        if nxt is None:
            if kv is not None:
                self.abort(ctx, [source])  # nobody will pull it: free the lease now
            kv = None
            nxt = self.policy.resume_decode(info, views, exclude)
        if nxt is None:
            raise upstream_failed("the decode worker serving this request shut down and no other is ready "
                                  "to continue it")
        log.info("request %s: %s is leaving; migrating to %s after %d tokens (%s)", ctx.request_id, source,
                 nxt.url, len(p.generated), "pulling its KV" if kv is not None else "recomputing")
        return nxt, kv, source if kv is not None else None

    def _moved(self, move: _Move, outcome: str) -> None:
        seconds = time.monotonic() - move.since
        self.metrics.migrations.labels(outcome).inc()
        if outcome != "failed":
            self.metrics.migration_seconds.observe(seconds)
        log.info("request %s: migrated from %s in %.1f ms (%s)", move.request_id, move.source, seconds * 1e3, outcome)

    async def _after_busy(
        self, info: RequestInfo, ctx: RequestContext, p: _Progress, excluded: set[str], busy: _Busy
    ) -> WorkerView:
        """The next decode worker once `busy` ones refused: one that has not, else (every one busy) a
        503 with Retry-After while the client has nothing yet, else a wait for the soonest
        Retry-After and another round, within `busy_wait_s` in all."""
        nxt = self.policy.resume_decode(info, self.pool.views(), frozenset(excluded | busy.retry_after.keys()))
        if nxt is not None:
            return nxt
        wait = min(busy.retry_after.values())
        if p.prompt_tokens is None:  # nothing sent yet: the client can come back later
            raise overloaded(wait)
        now = time.monotonic()
        busy.deadline = busy.deadline or now + self.busy_wait_s
        if now + wait > busy.deadline:
            raise overloaded(wait, "every decode worker stayed busy")
        log.info("request %s: every decode worker is busy; retrying in %.1f s", ctx.request_id, wait)
        await asyncio.sleep(wait)
        busy.retry_after.clear()
        nxt = self.policy.resume_decode(info, self.pool.views(), frozenset(excluded))
        if nxt is None:
            raise no_worker("no decode worker is ready to continue this request; retry shortly.")
        return nxt

    def _started(self, prompt_tokens: int, req: ParsedRequest, p: _Progress) -> Started:
        p.prompt_tokens = prompt_tokens
        check_prompt_tokens(prompt_tokens, req, self.limits)
        return Started(prompt_tokens)

    async def _stream(
        self, url: str, greq: GenerateRequest, req: ParsedRequest, p: _Progress
    ) -> AsyncIterator[Event]:
        """One generate call; raises WorkerFailed if it ends in anything but a finish."""
        async with contextlib.aclosing(self.client.generate(url, greq)) as stream:
            async for ev in stream:
                if ev.type is EventType.HEARTBEAT:  # queued there: alive, nothing to pass on
                    continue
                if ev.type is EventType.MIGRATE:  # it is leaving: every token so far came before this
                    raise _Migrating(ev)
                if ev.type is EventType.ERROR:
                    err = ev.error or {}
                    if err.get("type") == "invalid_request_error" and not p.generated:
                        raise RouterError.from_body(400, {"error": err})
                    raise WorkerFailed(f"decode on {url}: {err.get('message')}", dead=False)
                if ev.type is EventType.START:
                    if p.prompt_tokens is None and ev.prompt_tokens is not None:
                        yield self._started(ev.prompt_tokens, req, p)
                    continue
                if p.prompt_tokens is None:  # a worker that sent no START
                    yield self._started((ev.usage or {}).get("prompt_tokens", 0), req, p)
                if ev.token_ids or ev.text:
                    p.generated.extend(ev.token_ids)
                    p.chars += len(ev.text)
                    yield Tokens(list(ev.token_ids), ev.text, ev.logprobs or None)
                if ev.type is EventType.FINISH:
                    reason = ev.finish_reason or FinishReason.STOP
                    if reason in (FinishReason.ABORT, FinishReason.ERROR):
                        raise WorkerFailed(f"decode on {url} ended with {reason}", dead=False)
                    p.finish_reason = reason.value
                    return
        raise WorkerFailed(f"the stream from {url} ended without a finish", dead=True)
