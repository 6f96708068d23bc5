"""Rounds of scrapes -> a typed snapshot over a window: what the planner decides from.

The operator scrapes the router pods and the prefill/decode pods once per interval into a
ScrapeRound and adds it to a MetricsWindow (kept between calls, like the planner's own state).
`MetricsWindow.snapshot()` takes the newest round against the newest one at least `window_s`
older: counters become rates, histograms become the observations of that window (so percentiles
are over the window, not since the process started). What could not be read stays visible: a pod
without a reading is counted as unreadable, a router missing makes `router` None, and every such
gap is spelled out in `problems`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tandem.planning.autoscaling.scrape import (
    Histogram,
    RouterReading,
    UnreadableMetrics,
    WorkerReading,
    parse_router,
    parse_worker,
)

ROUTER = "router"


@dataclass(frozen=True)
class PodScrape:
    """One pod's /metrics at one round: a reading, or why there is none."""

    name: str
    role: str  # router | prefill | decode
    ready: bool
    reading: RouterReading | WorkerReading | None = None
    error: str | None = None


def read_pod(name: str, role: str, ready: bool, text: str | None, error: str | None = None) -> PodScrape:
    """Parse one pod's /metrics text (None when the GET failed: `error` says why)."""
    if text is None:
        return PodScrape(name, role, ready, None, error or "no answer")
    try:
        reading = parse_router(text) if role == ROUTER else parse_worker(text)
    except UnreadableMetrics as e:
        return PodScrape(name, role, ready, None, str(e))
    return PodScrape(name, role, ready, reading)


@dataclass(frozen=True)
class ScrapeRound:
    time: float  # seconds, from the caller's clock
    pods: tuple[PodScrape, ...]

    def by_name(self) -> dict[str, PodScrape]:
        return {p.name: p for p in self.pods}


@dataclass(frozen=True)
class RouterWindow:
    """What the routers saw over the window, summed over router replicas that could be read."""

    ttft: Histogram
    itl: Histogram
    in_flight: float
    request_rate: float  # requests answered per second
    route_rates: dict[str, float]
    readable: int
    total: int


@dataclass(frozen=True)
class PodWindow:
    """One worker pod over the window. Rates are None when the pod has no earlier reading."""

    name: str
    role: str
    ready: bool
    readable: bool
    error: str | None = None
    running: float = 0.0
    waiting: float = 0.0
    leased: float = 0.0
    kv_blocks_used: float = 0.0
    kv_blocks_total: float = 0.0
    outstanding_prompt_tokens: float | None = None
    prompt_tokens_rate: float | None = None
    generation_tokens_rate: float | None = None
    busy_fraction: float | None = None  # share of the window spent in engine steps
    step_tokens_rate: float | None = None  # tokens the engine processed per second (prompts and decode)
    mean_batch: float | None = None  # tokens per step over the window


@dataclass(frozen=True)
class RoleWindow:
    """One worker role over the window: sums over its ready pods that could be read."""

    role: str
    pods: tuple[PodWindow, ...]
    ready: int = 0
    readable: int = 0  # ready pods with a reading
    rated: int = 0  # readable pods with an earlier reading too (they give rates)
    running: float = 0.0
    waiting: float = 0.0
    leased: float = 0.0
    kv_blocks_used: float = 0.0
    kv_blocks_total: float = 0.0
    outstanding_prompt_tokens: float | None = None  # None: some pod does not export it
    prompt_tokens_rate: float = 0.0  # prompt tokens added to the engines (arriving work)
    generation_tokens_rate: float = 0.0
    step_tokens_rate: float = 0.0  # tokens processed (done work)
    busy: float = 0.0  # replica-equivalents busy stepping (sum of busy fractions)

    @property
    def kv_usage(self) -> float | None:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total > 0 else None

    @property
    def unreadable(self) -> int:
        return self.ready - self.readable


@dataclass(frozen=True)
class Snapshot:
    time: float
    window_s: float | None  # None: a single round so far, no rates yet
    router: RouterWindow | None  # None: no router could be read
    roles: dict[str, RoleWindow]
    problems: tuple[str, ...] = ()


def _rate(now: float, then: float, seconds: float) -> float:
    """Counter rate over the window; a counter that went down restarted, so all of `now` is new."""
    return (now - then if now >= then else now) / seconds


def _pod_window(pod: PodScrape, base: PodScrape | None, seconds: float | None) -> PodWindow:
    r = pod.reading
    if not isinstance(r, WorkerReading):
        return PodWindow(pod.name, pod.role, pod.ready, False, pod.error or "no reading")
    w = PodWindow(pod.name, pod.role, pod.ready, True, None, r.running, r.waiting, r.leased, r.kv_blocks_used,
                  r.kv_blocks_total, r.outstanding_prompt_tokens)
    b = base.reading if base is not None else None
    if not isinstance(b, WorkerReading) or not seconds:
        return w
    steps = r.steps - b.steps if r.steps >= b.steps else r.steps
    tokens = r.step_tokens - b.step_tokens if r.step_tokens >= b.step_tokens else r.step_tokens
    return PodWindow(
        **{**w.__dict__,
           "prompt_tokens_rate": _rate(r.prompt_tokens, b.prompt_tokens, seconds),
           "generation_tokens_rate": _rate(r.generation_tokens, b.generation_tokens, seconds),
           "busy_fraction": min(1.0, _rate(r.busy_seconds, b.busy_seconds, seconds)),
           "step_tokens_rate": tokens / seconds,
           "mean_batch": tokens / steps if steps > 0 else None})


def _role_window(role: str, pods: list[PodWindow]) -> RoleWindow:
    live = [p for p in pods if p.ready and p.readable]
    rated = [p for p in live if p.busy_fraction is not None]
    outstanding = [p.outstanding_prompt_tokens for p in live]
    return RoleWindow(
        role=role, pods=tuple(sorted(pods, key=lambda p: p.name)),
        ready=sum(p.ready for p in pods), readable=len(live), rated=len(rated),
        running=sum(p.running for p in live), waiting=sum(p.waiting for p in live),
        leased=sum(p.leased for p in live), kv_blocks_used=sum(p.kv_blocks_used for p in live),
        kv_blocks_total=sum(p.kv_blocks_total for p in live),
        outstanding_prompt_tokens=None if not live or None in outstanding else sum(outstanding),  # type: ignore[arg-type]
        prompt_tokens_rate=sum(p.prompt_tokens_rate or 0.0 for p in rated),
        generation_tokens_rate=sum(p.generation_tokens_rate or 0.0 for p in rated),
        step_tokens_rate=sum(p.step_tokens_rate or 0.0 for p in rated),
        busy=sum(p.busy_fraction or 0.0 for p in rated),
    )


def _router_window(now: ScrapeRound, base: ScrapeRound | None, seconds: float | None) -> RouterWindow | None:
    routers = [p for p in now.pods if p.role == ROUTER]
    readable = [p for p in routers if isinstance(p.reading, RouterReading)]
    if not readable or base is None or not seconds:
        return None
    before = base.by_name()
    ttft = itl = None
    in_flight = requests = 0.0
    routes: dict[str, float] = {}
    for p in readable:
        r: RouterReading = p.reading  # type: ignore[assignment]
        old = before.get(p.name)
        o = old.reading if old is not None and isinstance(old.reading, RouterReading) else None
        t, i = r.ttft.since(o.ttft if o else None), r.itl.since(o.itl if o else None)
        ttft = t if ttft is None else ttft.plus(t)
        itl = i if itl is None else itl.plus(i)
        in_flight += r.in_flight
        requests += _rate(r.requests, o.requests if o else 0.0, seconds)
        for route, n in r.routes.items():
            routes[route] = routes.get(route, 0.0) + _rate(n, (o.routes.get(route, 0.0) if o else 0.0), seconds)
    return RouterWindow(ttft=ttft, itl=itl, in_flight=in_flight, request_rate=requests,  # type: ignore[arg-type]
                        route_rates=routes, readable=len(readable), total=len(routers))


def _problems(now: ScrapeRound, roles: Mapping[str, RoleWindow]) -> list[str]:
    out = []
    routers = [p for p in now.pods if p.role == ROUTER]
    bad = [p for p in routers if not isinstance(p.reading, RouterReading)]
    if not routers:
        out.append("no router pod to read TTFT and ITL from")
    for p in bad:
        out.append(f"router {p.name}: {p.error or 'no reading'}")
    for rw in roles.values():
        for p in rw.pods:
            if p.ready and not p.readable:
                out.append(f"{rw.role} pod {p.name}: {p.error}")
    return out


@dataclass(frozen=True)
class MetricsWindow:
    """The rounds a snapshot needs: the newest ones and the newest one at least window_s old."""

    window_s: float
    rounds: tuple[ScrapeRound, ...] = field(default_factory=tuple)

    def add(self, round_: ScrapeRound) -> MetricsWindow:
        rounds = [r for r in self.rounds if r.time < round_.time] + [round_]
        cutoff = round_.time - self.window_s
        old = [i for i, r in enumerate(rounds) if r.time <= cutoff]
        start = old[-1] if old else 0
        return MetricsWindow(self.window_s, tuple(rounds[start:]))

    def snapshot(self, roles: tuple[str, ...] = ("prefill", "decode")) -> Snapshot:
        """The newest round against the oldest kept (at least window_s older once history allows)."""
        if not self.rounds:
            raise ValueError("no scrape round yet")
        now = self.rounds[-1]
        base = self.rounds[0] if len(self.rounds) > 1 else None
        seconds = now.time - base.time if base is not None else None
        before = base.by_name() if base is not None else {}
        windows = {role: _role_window(role, [_pod_window(p, before.get(p.name), seconds)
                                             for p in now.pods if p.role == role]) for role in roles}
        return Snapshot(time=now.time, window_s=seconds, router=_router_window(now, base, seconds),
                        roles=windows, problems=tuple(_problems(now, windows)))
