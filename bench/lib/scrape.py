"""Reading the workers' and router's /metrics (Prometheus text) and /internal/kv/health: the one
scraper of every scenario, parsed by prometheus_client's own parser."""

from __future__ import annotations

import math

import aiohttp
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


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def mean_delta(before: dict[str, float], after: dict[str, float], histogram: str) -> float | None:
    """A histogram's mean over the interval between two scrapes (None when nothing was observed)."""
    n = delta(before, after, f"{histogram}_count")
    return delta(before, after, f"{histogram}_sum") / n if n else None


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


async def kv_health(session: aiohttp.ClientSession, url: str) -> dict:
    """/internal/kv/health of a worker ({} where it has none)."""
    return await get_json(session, url, "/internal/kv/health")


def kv_from_health(before: dict, after: dict, direction: str = "pull") -> dict[str, float]:
    """Per-run KV bytes and transfers from two /internal/kv/health readings.

    Used when /metrics lacks the tandem_kv_transfer_* series. The health endpoint keeps no total
    transfer time, so the time is estimated from the bytes and the recent bandwidth it reports.
    """
    b = (after.get("bytes_total") or {}).get(direction, 0) - (before.get("bytes_total") or {}).get(direction, 0)
    n = (after.get("transfers_total") or {}).get(direction, 0) - (
        before.get("transfers_total") or {}).get(direction, 0)
    bw = after.get("recent_bandwidth_bytes_per_second")
    return {"bytes": float(b), "count": float(n),
            "seconds": float(b) / bw if bw else math.nan, "source": "kv-health (time estimated)"}
