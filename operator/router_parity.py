"""The operator's read of the routers' reports (GET /internal/parity on every ready router pod): the
workers' handoff parity standing for HandoffVerified (tandem.operator.handoff_condition), and their
KV transfer health for KVTransferReady (tandem.operator.status.kv_condition).

A router polls each of its workers' /internal/info every second or so, and that answer carries the
worker's KV health; the router passes it on. So a resync asks one pod per router, never every worker:
the operator's idle traffic grows with the services, not with their replicas (BENCHMARKS.md, "Watch,
don't list"). The I/O rules of tandem.operator.probe hold: plain HTTP to the pods the owner chain
names, all at once, each within the probe timeout and PARITY_MAX_BYTES, never inflated, no redirect
followed; an answer is hostile until it parses as a report, and it is believed only about the pods
the operator itself found (a worker URL no owned pod has is ignored). Turned off with --no-kv-probe.
"""

from __future__ import annotations

import json

import aiohttp
from tandem.contracts.handoff_parity import PARITY_PATH, ParityReport
from tandem.contracts.kv_health import KVHealth
from tandem.contracts.names import pod_ready, pod_url
from tandem.operator.config import OperatorConfig
from tandem.operator.handoff_condition import RouterParity
from tandem.operator.probe import count_failures, get_all
from tandem.operator.spec import ROUTER, WORKER_ROLES
from tandem.operator.status import KVProbe, Observation

PARITY_MAX_BYTES = 256 * 1024  # a report is about 1 KiB per worker


def _targets(obs: Observation) -> list[tuple[str, str]]:
    """(pod name, report URL) of every ready router pod."""
    ro = obs.roles.get(ROUTER)
    out = []
    for pod in ro.pods if ro else []:
        url = pod_url(pod)
        if url is not None and pod_ready(pod):
            out.append((pod["metadata"]["name"], url + PARITY_PATH))
    return sorted(out)


def _parse(pod: str, url: str, body: str | None, error: str | None) -> RouterParity:
    if body is None:
        return RouterParity(pod, error=error)
    try:
        return RouterParity(pod, ParityReport.from_dict(json.loads(body)))
    except (TypeError, ValueError, KeyError, AttributeError):
        return RouterParity(pod, error=f"{url} answered no parity report")


async def read_routers(obs: Observation, config: OperatorConfig,
                       session: aiohttp.ClientSession | None = None) -> list[RouterParity] | None:
    """Every ready router's report, or why it could not be read; None when probing is turned off."""
    if not config.kv_probe:
        return None
    found = _targets(obs)
    answers = await get_all([url for _, url in found], config.kv_probe_timeout_s, PARITY_MAX_BYTES, session)
    reports = [_parse(pod, url, body, error) for (pod, url), (body, error) in zip(found, answers, strict=True)]
    count_failures("router_report", [r.error for r in reports])
    return reports


def worker_health(obs: Observation, routers: list[RouterParity] | None) -> list[KVProbe] | None:
    """Each ready prefill and decode pod's KV health, from what the routers report of it; None when
    the routers are not read (--no-kv-probe). A pod no router reports on says why (no router ready,
    its report unreadable, the router cannot reach the worker, or has not polled it yet). Where two
    routers disagree, the unhealthy report wins: a failure one router's traffic found is real."""
    if routers is None:
        return None
    health: dict[str, KVHealth] = {}
    unreachable: dict[str, str] = {}
    for r in routers:
        if r.report is None:
            continue
        unreachable |= r.report.unreachable
        for url, h in r.report.kv_health.items():
            if url not in health or (h.healthy is False and health[url].healthy is not False):
                health[url] = h
    unread = "; ".join(f"router pod {r.pod}: {r.error}" for r in routers if r.error)
    out = []
    for role in WORKER_ROLES:
        ro = obs.roles.get(role)
        for pod in ro.pods if ro else []:
            url = pod_url(pod)
            if url is None or not pod_ready(pod):
                continue  # pods still starting are not judged (their Ready says it)
            name = pod["metadata"]["name"]
            if url in health:
                out.append(KVProbe(name, role, health=health[url]))
            else:
                out.append(KVProbe(name, role, error=_unreported(url, routers, unreachable, unread)))
    return sorted(out, key=lambda p: (p.role, p.pod))


def _unreported(url: str, routers: list[RouterParity], unreachable: dict[str, str], unread: str) -> str:
    if url in unreachable:
        return f"its router cannot reach it: {unreachable[url]}"
    if not routers:
        return "no router pod is ready to report it"
    if unread:
        return f"no router report names it ({unread})"
    return "no router has polled it yet"
