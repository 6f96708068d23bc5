"""The driver of a request's journey: performs what `decide` (decide.py) asks, and nothing else.

One request's state lives in its `Journey` (journey.py); what happens next is `decide`'s call,
a pure step over the journey, an outcome (outcomes.py) and a snapshot this driver takes of the
worker set (`WorkerSet.snapshot`), giving an action (actions.py). This driver does the I/O around it: it calls workers through a
`WorkerClient` (worker_client.py, an in-process fake in the tests), hands the worker set what the
journey now counts on each worker (`Journey.charges`) and the round-robin turns an action took,
sleeps when told to wait, sends aborts, counts metrics and writes the log, and turns what happened
into the next outcome. It yields router-level events (Started, Tokens, Finished) and raises
RouterError; app.py turns those into OpenAI responses.

A request that ends early (client gone, an error) is aborted on every worker it touched, with the
lease token it holds there, so nothing stays allocated. See docs/request-lifecycle.md for the whole
path, state by state.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

from tandem.contracts import timing
from tandem.contracts.protocol import StreamEvent
from tandem.router.actions import (
    Abort,
    Action,
    Blame,
    DecodeOn,
    EndWithError,
    Finish,
    Moved,
    PrefillOn,
    Read,
    Wait,
    Why,
)
from tandem.router.decide import decide
from tandem.router.errors import RouterError
from tandem.router.journey import Event, Journey, Rules
from tandem.router.metrics import RouterMetrics
from tandem.router.outcomes import (
    Aborted,
    Arrived,
    CallFailed,
    Line,
    Outcome,
    Prefilled,
    Rejected,
    Waited,
    may_choose,
)
from tandem.router.policies.base import RequestInfo, RoutingPolicy, Snapshot
from tandem.router.validation import Limits, ParsedRequest
from tandem.router.worker_client import HandoffDiverged, WorkerBusy, WorkerClient, WorkerFailed
from tandem.router.workers import WorkerSet

log = logging.getLogger("tandem.router")


class _Stream:
    """One open /internal/generate call."""

    def __init__(self, orch: Orchestrator, url: str, j: Journey) -> None:
        self.url = url
        orch.metrics.worker_requests.labels("decode").inc()
        self._events: AsyncGenerator[StreamEvent, None] = orch.client.generate(url, j.worker_request(decode=True))
        self._open = True

    async def next(self) -> StreamEvent:
        try:
            return await anext(self._events)
        except StopAsyncIteration:
            raise WorkerFailed(f"the stream from {self.url} ended without a finish", dead=True) from None

    async def close(self) -> None:
        if self._open:
            self._open = False
            await self._events.aclose()


@dataclass
class Orchestrator:
    client: WorkerClient
    workers: WorkerSet
    policy: RoutingPolicy
    metrics: RouterMetrics
    limits: Limits = field(default_factory=Limits)
    max_prefill_attempts: int = 2
    max_resumes: int = 2
    busy_wait_s: float = timing.BUSY_WAIT_S  # waiting for a busy decode worker once the client has tokens
    hold_first_token: bool = False  # --first-token with-decode (Rules)
    _background: set[asyncio.Task] = field(default_factory=set)

    @property
    def rules(self) -> Rules:
        return Rules(self.policy, self.limits, self.max_prefill_attempts, self.max_resumes, self.busy_wait_s,
                     self.hold_first_token)

    # --- aborts, failures, metrics ------------------------------------------------------------

    def abort(self, j: Journey, urls: list[str] | tuple[str, ...] | None = None) -> None:
        """Fire-and-forget aborts (with the lease token the journey holds there): they must outlive
        a cancelled handler."""
        for url in j.touched if urls is None else urls:
            self.metrics.aborts.inc()
            task = asyncio.get_running_loop().create_task(
                self.client.abort(url, j.request_id, j.lease_tokens.get(url)))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def drain(self) -> None:
        """Wait for the aborts still on their way (at shutdown, and in tests)."""
        while self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    def _blamed(self, blame: Blame) -> None:
        log.warning("%s", blame.error)
        if isinstance(blame.error, WorkerBusy):
            self.metrics.worker_busy.labels(blame.role).inc()
            return
        self.metrics.worker_failures.labels(blame.role).inc()
        if isinstance(blame.error, HandoffDiverged):
            self.metrics.handoffs_diverged.inc()
        if blame.error.dead:
            self.workers.report_failure(blame.url, str(blame.error))

    def _count_prefix(self, info: RequestInfo | None, action: Action) -> None:
        route = action.route
        if route is None or info is None or info.prompt_token_ids is None:
            return
        self.metrics.routed_prompt_tokens.inc(info.prompt_tokens)
        if route.prefill is not None:
            self.metrics.prefix_cached_tokens.labels("prefill").inc(route.cached_prefill_tokens)
        self.metrics.prefix_cached_tokens.labels("decode").inc(route.cached_decode_tokens)

    def _moved(self, j: Journey, moved: Moved) -> None:
        self.metrics.migrations.labels(moved.outcome).inc()
        if moved.outcome != "failed":
            self.metrics.migration_seconds.observe(moved.seconds)
        log.info("request %s: migrated from %s in %.1f ms (%s)", j.request_id, moved.source, moved.seconds * 1e3,
                 moved.outcome)

    def _effects(self, j: Journey, action: Action) -> None:
        """What an action asks besides its next step, in the order the state machine did them."""
        if action.blame is not None:
            self._blamed(action.blame)
        for level, message in action.notes:
            log.log(level, "%s", message)
        self._count_prefix(j.info, action)
        if action.route_reason is not None:
            self.metrics.routes.labels(action.route_reason).inc()
        if action.moved is not None:
            self._moved(j, action.moved)
        if action.abort:
            self.abort(j, action.abort)
        if isinstance(action, DecodeOn) and action.why is Why.RESUME:
            self.metrics.resumes.inc()

    # --- one request --------------------------------------------------------------------------

    def _outcome(self, cls: type, *args) -> Outcome:
        return cls(*args, now=time.monotonic())

    def _decide(self, j: Journey, outcome: Outcome) -> Action:
        """`decide` over a snapshot taken now (where a choice may follow), then what the action changed
        in the worker set: the journey's charges there, the round-robin turns it took."""
        info = outcome.info if isinstance(outcome, Arrived) else j.info
        snap = self.workers.snapshot(info) if may_choose(outcome) else Snapshot()
        action = decide(j, outcome, snap)
        self.workers.account(j.request_id, j.charges)
        self.workers.took_turns(action.turns)
        return action

    async def run(self, req: ParsedRequest, j: Journey) -> AsyncIterator[Event]:
        """The events of one request. Raises RouterError for anything the client must see."""
        stream: _Stream | None = None
        try:
            action = self._decide(j, Arrived.of(req, self.rules, j.request_id, now=time.monotonic()))
            while True:
                if stream is not None and not isinstance(action, Read):
                    await stream.close()  # the worker sent its last line (or failed)
                    stream = None
                self._effects(j, action)
                for ev in action.emit:
                    yield ev
                if isinstance(action, EndWithError):
                    raise action.error
                if isinstance(action, Finish):
                    return
                if isinstance(action, DecodeOn):
                    stream = _Stream(self, action.worker.url, j)
                outcome = await (self._read(stream) if stream is not None else self._call(j, action))
                action = self._decide(j, outcome)
        finally:
            self.workers.account(j.request_id, {})  # whatever it still counted on a worker
            if stream is not None:
                await stream.close()
            if j.move is not None:  # the request ended while it was moving
                self._moved(j, Moved(j.move.source, "failed", time.monotonic() - j.move.since))
                j.move = None
            if not j.done:
                self.abort(j)

    async def _read(self, stream: _Stream) -> Outcome:
        """The next line of the open decode stream, or how the stream failed."""
        try:
            ev = await stream.next()
        except WorkerFailed as exc:
            return self._outcome(CallFailed, stream.url, exc)
        except RouterError as err:
            return self._outcome(Rejected, err)
        return self._outcome(Line, stream.url, ev)

    async def _call(self, j: Journey, action: Action) -> Outcome:
        """Perform a step that is not a decode stream: a prefill call, an awaited abort, a wait."""
        if isinstance(action, PrefillOn):
            return await self._prefill(j, action)
        if isinstance(action, Abort):
            self.metrics.aborts.inc()
            await self.client.abort(action.url, j.request_id, j.lease_tokens.get(action.url))
            return self._outcome(Aborted, action.url)
        if isinstance(action, Wait):
            await asyncio.sleep(action.seconds)
            return self._outcome(Waited)
        raise TypeError(f"not a step to perform: {action!r}")

    async def _prefill(self, j: Journey, action: PrefillOn) -> Outcome:
        url = action.worker.url
        self.metrics.worker_requests.labels("prefill").inc()
        try:
            res = await self.client.prefill(url, j.worker_request(decode=False))
        except WorkerFailed as exc:
            return self._outcome(CallFailed, url, exc)
        except RouterError as err:
            return self._outcome(Rejected, err)
        return self._outcome(Prefilled, url, res)
