"""What processes counted over a run: the workers' and router's /metrics (Prometheus text, parsed
by prometheus_client's own parser: the one scraper of every scenario), each process's CPU and the
machine's, read before and after (Counters)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import aiohttp
import psutil
from prometheus_client.parser import text_string_to_metric_families


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(sample name, labels, value) of every sample, NaN values left out."""
    out = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not math.isnan(s.value):
                out.append((s.name, dict(s.labels), float(s.value)))
    return out


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample name -> value summed over every label set (most questions here have no labels).

    `_bucket` series are skipped: their sum over `le` means nothing.
    """
    out: dict[str, float] = {}
    for name, _, v in samples(text):
        if not name.endswith("_bucket"):
            out[name] = out.get(name, 0.0) + v
    return out


def by_label(text: str, name: str, label: str) -> dict[str, float]:
    """One series' values by one label, e.g. the router's routes by route."""
    out: dict[str, float] = {}
    for n, labels, v in samples(text):
        if n == name:
            key = labels.get(label, "")
            out[key] = out.get(key, 0.0) + v
    return out


async def scrape_text(session: aiohttp.ClientSession, url: str) -> str:
    """The /metrics text of one process; empty when it does not answer (never fails a run)."""
    try:
        async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp:
            return await resp.text() if resp.status == 200 else ""
    except (aiohttp.ClientError, TimeoutError):
        return ""


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The parsed /metrics of one process ({} when it does not answer)."""
    return parse_prometheus(await scrape_text(session, url))


async def route_counts(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The router's tandem_router_routes_total by route."""
    return by_label(await scrape_text(session, url), "tandem_router_routes_total", "route")


async def get_json(session: aiohttp.ClientSession, url: str, path: str) -> dict:
    """GET url+path as JSON ({} when it does not answer 200)."""
    try:
        async with session.get(f"{url}{path}", timeout=aiohttp.ClientTimeout(total=5)) as r:
            return await r.json() if r.status == 200 else {}
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return {}


def busy_cpu_seconds() -> float:
    """Non-idle CPU seconds of the whole machine so far (every core: others share them)."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


@dataclass
class Counters:
    """What a set of processes has counted so far; `after - before` is what they did in between."""

    metrics: dict[str, dict[str, float]]  # process name -> its /metrics, summed over label sets
    routes: dict[str, float]  # the router's tandem_router_routes_total by route
    cpu_s: dict[str, float]  # process name -> CPU seconds (its children included)
    loadgen_s: float  # this process's CPU seconds: the load generator's
    busy_s: float  # the machine's busy CPU seconds

    def __sub__(self, before: Counters) -> Counters:
        return Counters({n: {k: v - before.metrics.get(n, {}).get(k, 0.0) for k, v in m.items()}
                         for n, m in self.metrics.items()},
                        {k: v - before.routes.get(k, 0.0) for k, v in self.routes.items()
                         if v > before.routes.get(k, 0.0)},
                        {n: v - before.cpu_s.get(n, 0.0) for n, v in self.cpu_s.items()},
                        self.loadgen_s - before.loadgen_s, self.busy_s - before.busy_s)

    def mean(self, process: str, histogram: str) -> float | None:
        """A histogram's mean over the interval (None when nothing was observed)."""
        m = self.metrics.get(process, {})
        n = m.get(f"{histogram}_count", 0.0)
        return m.get(f"{histogram}_sum", 0.0) / n if n else None


async def read_counters(procs: Iterable) -> Counters:
    """Every process's /metrics and CPU, the router's routes (BenchProcesses: role, name, url)."""
    procs = list(procs)
    async with aiohttp.ClientSession() as s:
        metrics = {p.name: await scrape(s, p.url) for p in procs if p.role != "router"}
        routes = {}
        for p in procs:
            if p.role == "router":
                routes = await route_counts(s, p.url)
    me = psutil.Process().cpu_times()
    return Counters(metrics, routes, {p.name: p.cpu_seconds() for p in procs}, me.user + me.system,
                    busy_cpu_seconds())
