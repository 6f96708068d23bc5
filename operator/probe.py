"""Probing the workers' KV transfer health for KVTransferReady: the operator's only pod traffic.

GET http://<podIP>:<worker port>/internal/kv/health on every ready prefill and decode pod, all at
once, each bounded by a short timeout, so one wedged worker never delays the others (or the
reconciliation of other InferenceServices). Plain HTTP to pods: no Kubernetes API, no RBAC.
What the answers mean is decided in status.kv_condition; this module only does the I/O.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp
from tandem.contracts.kv_health import KVHealth
from tandem.contracts.names import pod_ready, pod_url
from tandem.operator.spec import WORKER_ROLES
from tandem.operator.status import KVProbe, Observation

HEALTH_PATH = "/internal/kv/health"


@dataclass(frozen=True)
class Target:
    """One ready worker pod and where its health endpoint answers."""

    pod: str
    role: str
    url: str


def targets(obs: Observation) -> list[Target]:
    """Every ready prefill and decode pod; pods still starting are not asked (their Ready says it)."""
    out = []
    for role in WORKER_ROLES:
        ro = obs.roles.get(role)
        for pod in ro.pods if ro else []:
            url = pod_url(pod)
            if pod_ready(pod) and url is not None:
                out.append(Target(pod["metadata"]["name"], role, url + HEALTH_PATH))
    return sorted(out, key=lambda t: (t.role, t.pod))


async def _probe(session: aiohttp.ClientSession, target: Target) -> KVProbe:
    try:
        async with session.get(target.url) as resp:
            if resp.status != 200:
                return KVProbe(target.pod, target.role, error=f"HTTP {resp.status} from {target.url}")
            health = await resp.json(content_type=None)
    except TimeoutError:
        return KVProbe(target.pod, target.role, error=f"no answer from {target.url} in time")
    except (aiohttp.ClientError, OSError, ValueError) as e:
        return KVProbe(target.pod, target.role, error=f"{target.url}: {e or type(e).__name__}")
    try:
        return KVProbe(target.pod, target.role, health=KVHealth.from_dict(health))
    except (TypeError, ValueError, AttributeError):
        return KVProbe(target.pod, target.role, error=f"{target.url} answered no KV health document")


async def probe_all(found: list[Target], timeout_s: float) -> list[KVProbe]:
    """One probe per target, concurrently; a probe that fails says why instead of raising."""
    if not found:
        return []
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, trust_env=False) as session:
        return list(await asyncio.gather(*(_probe(session, t) for t in found)))
