"""The operator's traffic to pods: KV transfer health for KVTransferReady, and /metrics for the planner.

GET http://<podIP>:<http port>/internal/kv/health on every ready prefill and decode pod (and
/metrics on those and the router pods, tandem.operator.autoscaling.autoscaler), all at once, each
bounded by a short timeout, so one wedged pod never delays the others (or the reconciliation of
other InferenceServices). Plain HTTP to pods: no Kubernetes API, no RBAC, no secret (neither endpoint
needs one). What the answers mean is decided elsewhere (status.kv_condition, the planner); this
module only does the I/O.

The operator is shared by every tenant and a pod runs whatever image its InferenceService names, so
an answer is hostile until read: at most HEALTH_MAX_BYTES or METRICS_MAX_BYTES are read (a larger
answer is an error, and the rest is never received), a compressed answer is refused rather than
inflated (a gzip bomb), a redirect is a failure, never followed (it would point the operator at any
address, and that address's answer would land in the service's status), and metrics pages are
parsed in a thread, so the event loop keeps serving every other service meanwhile. Which pods are
asked is decided by their owner chain (tandem.operator.observe), not by labels a pod can copy.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import aiohttp
from tandem.contracts.kv_health import KVHealth
from tandem.contracts.names import pod_ready, pod_url
from tandem.contracts.runtimes import DEFAULT_RUNTIME
from tandem.operator.config import OperatorConfig
from tandem.operator.metrics import METRICS, failure_reason
from tandem.operator.spec import WORKER_ROLES
from tandem.operator.status import KVProbe, Observation
from tandem.planning.autoscaling.snapshot import PodScrape, read_pod

HEALTH_PATH = "/internal/kv/health"
HEALTH_MAX_BYTES = 64 * 1024  # a health document is well under 4 KiB
METRICS_MAX_BYTES = 2 * 1024 * 1024  # a worker's or router's page is tens of KiB
CHUNK = 64 * 1024


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


async def _read(resp: aiohttp.ClientResponse, url: str, max_bytes: int) -> tuple[str | None, str | None]:
    """The body of a 200 answer, read up to `max_bytes` and no further."""
    encoding = resp.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        return None, f"{url} answered with Content-Encoding {encoding} (the operator reads only identity)"
    too_big = f"{url} answered more than {max_bytes} bytes"
    if resp.content_length is not None and resp.content_length > max_bytes:
        return None, too_big
    body = bytearray()
    async for chunk in resp.content.iter_chunked(CHUNK):
        body += chunk
        if len(body) > max_bytes:
            return None, too_big
    return body.decode("utf-8", errors="replace"), None


async def _get(session: aiohttp.ClientSession, url: str, max_bytes: int,
               limit: aiohttp.ClientTimeout) -> tuple[str | None, str | None]:
    """(body, None) for a 200, else (None, why): never raises for what a pod answers or does not.
    A redirect is not followed: it would let a pod point the operator at any address it can reach."""
    try:
        async with session.get(url, headers={"Accept-Encoding": "identity"}, timeout=limit,
                               allow_redirects=False) as resp:
            if 300 <= resp.status < 400:
                return None, f"HTTP {resp.status} from {url}: a redirect, which the operator does not follow"
            if resp.status != 200:
                return None, f"HTTP {resp.status} from {url}"
            return await _read(resp, url, max_bytes)
    except TimeoutError:
        return None, f"no answer from {url} in time"
    except (aiohttp.ClientError, OSError, ValueError) as e:
        return None, f"{url}: {e or type(e).__name__}"


def new_session() -> aiohttp.ClientSession:
    """A session for pod answers (compressed ones are refused, not inflated); the controller keeps one
    for the process, so a pass does not build a connection pool."""
    return aiohttp.ClientSession(trust_env=False, auto_decompress=False)


async def get_all(urls: list[str], timeout_s: float, max_bytes: int,
                  session: aiohttp.ClientSession | None = None) -> list[tuple[str | None, str | None]]:
    """GET every URL concurrently, each within timeout_s and max_bytes: (body, None) or (None, why)."""
    if not urls:
        return []
    if session is None:
        async with new_session() as own:
            return await get_all(urls, timeout_s, max_bytes, own)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    return list(await asyncio.gather(*(_get(session, url, max_bytes, timeout) for url in urls)))


def _kv_probe(target: Target, body: str | None, error: str | None) -> KVProbe:
    if body is None:
        return KVProbe(target.pod, target.role, error=error)
    try:
        return KVProbe(target.pod, target.role, health=KVHealth.from_dict(json.loads(body)))
    except (TypeError, ValueError, AttributeError):
        return KVProbe(target.pod, target.role, error=f"{target.url} answered no KV health document")


async def probe_all(found: list[Target], timeout_s: float,
                    session: aiohttp.ClientSession | None = None) -> list[KVProbe]:
    """One probe per target, concurrently; a probe that fails says why instead of raising."""
    answers = await get_all([t.url for t in found], timeout_s, HEALTH_MAX_BYTES, session)
    probes = [_kv_probe(t, body, error) for t, (body, error) in zip(found, answers, strict=True)]
    _count("kv_health", [p.error for p in probes])
    return probes


async def probe_workers(obs: Observation, config: OperatorConfig,
                        session: aiohttp.ClientSession | None = None,
                        runtime: str = DEFAULT_RUNTIME) -> list[KVProbe] | None:
    """The ready workers' KV health for KVTransferReady; None when probing is turned off, or when
    the runtime's servers have no such report (vllm: status.kv_condition says NotApplicable), so a
    vLLM pod is never asked for a page it does not serve and counted as a failed scrape."""
    if not config.kv_probe or runtime != DEFAULT_RUNTIME:
        return None
    return await probe_all(targets(obs), config.kv_probe_timeout_s, session)


async def read_metrics(pods: list[tuple[str, str, bool, str | None]], timeout_s: float,
                       session: aiohttp.ClientSession | None = None) -> list[PodScrape]:
    """(name, role, ready, /metrics URL or None) per pod -> what each pod's /metrics says, or why not."""
    urls = [url for *_, url in pods if url is not None]
    answers = iter(await get_all(urls, timeout_s, METRICS_MAX_BYTES, session))
    pages = []
    for name, role, ready, url in pods:
        text, error = next(answers) if url is not None else (None, "not ready" if not ready else "no pod IP")
        pages.append((name, role, ready, text, error))
    scrapes = await parse_pages(pages)
    _count("metrics", [s.error for s, (*_, url) in zip(scrapes, pods, strict=True) if url is not None])
    return scrapes


def _count(kind: str, errors: list[str | None]) -> None:
    for error in errors:
        if error:
            METRICS.scrape_failures.labels(kind, failure_reason(error)).inc()


Page = tuple[str, str, bool, "str | None", "str | None"]  # name, role, ready, text, why no text


async def parse_pages(pages: list[Page]) -> list[PodScrape]:
    """Parses /metrics pages in a thread: up to METRICS_MAX_BYTES each, they must not stall the loop."""
    if not any(text for _, _, _, text, _ in pages):
        return [read_pod(*page) for page in pages]
    return await asyncio.to_thread(lambda: [read_pod(*page) for page in pages])
