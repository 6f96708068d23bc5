"""Flow control: the router holds requests in one queue per flow and lets them on to the workers in a
fair order, so a tenant that floods the service waits behind its own requests, not in front of
everyone else's (the Gateway API Inference Extension's flow control, as llm-d's endpoint picker has it).

A flow is (fairness id, priority). The fairness id is the `x-gateway-inference-fairness-id` header,
else the caller's API key (hashed: the key itself is never kept), else one shared id. The priority
comes from the request's objective (`x-gateway-inference-objective`, looked up in
`FlowConfig.objectives`; an objective nobody configured, or none, is priority 0). Higher priorities
go first; within a priority band, flows take turns (round-robin), each flow first in, first out.

At most `max_concurrent` requests are past the gate at once (0 turns flow control off: every request
goes on at once, as before), and one flow at most `max_concurrent - headroom` of them: the last
`headroom` places are never all one flow's, so another tenant's request starts at once instead of
waiting for a flood's request to end (a gate is not preemptive: without it, a newcomer waits for a
whole request of the flood to finish). A request that finds no room waits in its flow's queue for at most
`ttl_s`; one whose band already holds `band_capacity` waiting requests is refused at once. Both are
429 with Retry-After, OpenAI's `rate_limit_exceeded`: the service is there, it is full for this flow.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections import Counter, OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field

from tandem.contracts.protocol import MAX_FAIRNESS_ID_CHARS
from tandem.router.errors import RouterError

FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
OBJECTIVE_HEADER = "x-gateway-inference-objective"
SHARED_FLOW = "default"


@dataclass(frozen=True)
class FlowConfig:
    max_concurrent: int = 0  # requests past the gate at once; 0: flow control off
    band_capacity: int = 256  # requests waiting per priority band before a new one is refused
    ttl_s: float = 30.0  # how long a request may wait for its turn
    objectives: Mapping[str, int] = field(default_factory=dict)  # objective name -> priority
    headroom: int = 1  # places one flow never takes (while it would hold all of them)

    @property
    def enabled(self) -> bool:
        return self.max_concurrent > 0

    @property
    def per_flow(self) -> int:
        """The most places one flow holds at once."""
        return max(1, self.max_concurrent - self.headroom)


def flow_of(headers: Mapping[str, str], api_key: str | None, config: FlowConfig) -> tuple[str, int]:
    """(fairness id, priority) of a request from its headers and the API key it presented."""
    fairness = (headers.get(FAIRNESS_HEADER) or "").strip()
    if len(fairness) > MAX_FAIRNESS_ID_CHARS:  # the workers keep it per sequence: a long one by its hash
        fairness = "id:" + hashlib.sha256(fairness.encode()).hexdigest()[:16]
    if not fairness and api_key:
        fairness = "key:" + hashlib.sha256(api_key.encode()).hexdigest()[:16]
    objective = (headers.get(OBJECTIVE_HEADER) or "").strip()
    return fairness or SHARED_FLOW, config.objectives.get(objective, 0)


class FlowRefused(RouterError):
    """429 with Retry-After; `reason` is band_full or ttl."""

    def __init__(self, reason: str, message: str, retry_after_s: float) -> None:
        wait = max(1, round(retry_after_s))
        super().__init__(429, f"{message}; retry after {wait} s.", "rate_limit_exceeded", None,
                         "rate_limit_exceeded", headers={"Retry-After": str(wait)})
        self.reason = reason


@dataclass
class _Band:
    """One priority's waiting requests: flow id -> its queue, in the order flows take turns."""

    flows: OrderedDict[str, deque[asyncio.Future[None]]] = field(default_factory=OrderedDict)
    size: int = 0

    def push(self, flow: str, waiter: asyncio.Future[None]) -> None:
        self.flows.setdefault(flow, deque()).append(waiter)
        self.size += 1

    def pop(self, eligible: Callable[[str], bool]) -> tuple[str, asyncio.Future[None]] | None:
        """The oldest request of the next flow in turn that may take a place; that flow goes to the
        back of the turns (a flow that may not keeps its turn)."""
        for flow in list(self.flows):
            if not eligible(flow):
                continue
            queue = self.flows[flow]
            waiter = queue.popleft()
            self.size -= 1
            if queue:
                self.flows.move_to_end(flow)
            else:
                del self.flows[flow]
            return flow, waiter
        return None

    def remove(self, flow: str, waiter: asyncio.Future[None]) -> None:
        queue = self.flows.get(flow)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            self.size -= 1
            if not queue:
                del self.flows[flow]


class FlowController:
    """The gate (see the module docstring). One per router process; event-loop only."""

    def __init__(self, config: FlowConfig) -> None:
        self.config = config
        self.in_flight = 0
        self.held: Counter[str] = Counter()  # flow -> places it holds
        self._bands: dict[int, _Band] = {}
        self.refused: dict[str, int] = {"band_full": 0, "ttl": 0}

    def waiting(self, priority: int | None = None) -> int:
        if priority is not None:
            band = self._bands.get(priority)
            return band.size if band else 0
        return sum(b.size for b in self._bands.values())

    @contextlib.asynccontextmanager
    async def admit(self, flow: str, priority: int = 0) -> AsyncIterator[None]:
        """Past the gate for as long as the block runs (a stream holds its place until it ends);
        raises the 429 when the band is full or the wait outlasts the TTL."""
        if not self.config.enabled:
            yield
            return
        if self.in_flight < self.config.max_concurrent and self._may_take(flow) and not self.waiting():
            self._take(flow)
        else:
            await self._wait(flow, priority)
        try:
            yield
        finally:
            self._release(flow)

    async def _wait(self, flow: str, priority: int) -> None:
        band = self._bands.setdefault(priority, _Band())
        if band.size >= self.config.band_capacity:
            self.refused["band_full"] += 1
            raise FlowRefused("band_full", f"{band.size} requests of priority {priority} are already waiting",
                              self.config.ttl_s)
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        band.push(flow, waiter)
        self._dispatch()  # a place this flow may take may be free (others wait at their limit)
        try:
            async with asyncio.timeout(self.config.ttl_s):  # (3.11's wait_for can swallow a cancel)
                await asyncio.shield(waiter)
        except TimeoutError:
            band.remove(flow, waiter)
            if waiter.done():  # granted as the timer fired: take the place after all
                return
            waiter.cancel()
            self.refused["ttl"] += 1
            raise FlowRefused("ttl", f"waited {self.config.ttl_s:g} s for a turn", self.config.ttl_s) from None
        except asyncio.CancelledError:  # the client went away while waiting
            band.remove(flow, waiter)
            if waiter.done() and not waiter.cancelled():
                self._release(flow)  # it had been let in: pass the place on
            waiter.cancel()
            raise

    def _may_take(self, flow: str) -> bool:
        return self.held[flow] < self.config.per_flow

    def _take(self, flow: str) -> None:
        self.in_flight += 1
        self.held[flow] += 1

    def _release(self, flow: str) -> None:
        self.in_flight -= 1
        self.held[flow] -= 1
        if not self.held[flow]:
            del self.held[flow]
        self._dispatch()

    def _dispatch(self) -> None:
        """Free places to the waiting requests: higher priorities first, flows in turn, none past its limit."""
        while self.in_flight < self.config.max_concurrent:
            nxt = self._next()
            if nxt is None:
                return
            flow, waiter = nxt
            if not waiter.done():
                self._take(flow)
                waiter.set_result(None)

    def _next(self) -> tuple[str, asyncio.Future[None]] | None:
        for priority in sorted(self._bands, reverse=True):
            found = self._bands[priority].pop(self._may_take)
            if found is not None:
                return found
        return None
