"""Probing the workers' KV transfer health for KVTransferReady: the operator's only pod traffic.

GET http://<podIP>:<worker port>/internal/kv/health on every ready prefill and decode pod, all at
once, each bounded by a short timeout, so one wedged worker never delays the others (or the
reconciliation of other InferenceServices). Plain HTTP to pods: no Kubernetes API, no RBAC.
What the answers mean is decided in status.kv_condition; this module only does the I/O.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import aiohttp
from tandem.operator.config import WORKER_PORT
from tandem.operator.status import KVProbe, Observation

HEALTH_PATH = "/internal/kv/health"
WORKER_ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class Target:
    """One ready worker pod and where its health endpoint answers."""

    pod: str
    role: str
    url: str


def _pod_ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    conditions = status.get("conditions") or []
    return (
        not pod["metadata"].get("deletionTimestamp")
        and bool(status.get("podIP"))
        and any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    )


def _worker_port(pod: dict[str, Any]) -> int:
    """The container port named http (what render gives workers), else the default worker port."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "http":
                return int(port["containerPort"])
    return WORKER_PORT


def targets(obs: Observation) -> list[Target]:
    """Every ready prefill and decode pod; pods still starting are not asked (their Ready says it)."""
    out = []
    for role in WORKER_ROLES:
        ro = obs.roles.get(role)
        for pod in ro.pods if ro else []:
            if _pod_ready(pod):
                ip = pod["status"]["podIP"]
                host = f"[{ip}]" if ":" in ip else ip
                url = f"http://{host}:{_worker_port(pod)}{HEALTH_PATH}"
                out.append(Target(pod["metadata"]["name"], role, url))
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
    if not isinstance(health, dict):
        return KVProbe(target.pod, target.role, error=f"{target.url} answered no JSON object")
    return KVProbe(target.pod, target.role, health=health)


async def probe_all(found: list[Target], timeout_s: float) -> list[KVProbe]:
    """One probe per target, concurrently; a probe that fails says why instead of raising."""
    if not found:
        return []
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, trust_env=False) as session:
        return list(await asyncio.gather(*(_probe(session, t) for t in found)))
