"""Reading Prometheus text from the workers' and router's /metrics, for per-run deltas."""

from __future__ import annotations

import math
import re

import aiohttp

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample name -> value summed over every label set (the bench has no per-label questions).

    `_bucket` series are skipped: their sum over `le` means nothing.
    """
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m or m.group(1).endswith("_bucket"):
            continue
        try:
            v = float(m.group(3))
        except ValueError:
            continue
        if math.isnan(v):
            continue
        out[m.group(1)] = out.get(m.group(1), 0.0) + v
    return out


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The parsed /metrics of one process; empty when it does not answer (never fails a run)."""
    try:
        async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp:
            if resp.status != 200:
                return {}
            return parse_prometheus(await resp.text())
    except (aiohttp.ClientError, TimeoutError):
        return {}


async def kv_health(session: aiohttp.ClientSession, url: str) -> dict:
    """/internal/kv/health of a worker ({} where it has none)."""
    try:
        async with session.get(f"{url}/internal/kv/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
            return await r.json() if r.status == 200 else {}
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return {}


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


async def route_counts(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The router's tandem_router_routes_total by route."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
            text = await r.text()
    except (aiohttp.ClientError, TimeoutError):
        return {}
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "tandem_router_routes_total":
                out[s.labels.get("route", "")] = out.get(s.labels.get("route", ""), 0.0) + s.value
    return out
