"""The operator's traffic to pods: the routers' reports (tandem.operator.router_parity: handoff parity
and the workers' KV health), and /metrics for the planner.

GET http://<podIP>:<http port>/internal/parity on every ready router pod (and /metrics on those and
the prefill and decode pods, tandem.operator.autoscaling.autoscaler, when the planner runs), all at
once, each bounded by a short timeout, so one wedged pod never delays the others (or the
reconciliation of other InferenceServices). Plain HTTP to pods: no Kubernetes API, no RBAC, no secret
(neither endpoint needs one). What the answers mean is decided elsewhere (status.kv_condition,
handoff_condition, the planner); this module only does the I/O.

The operator is shared by every tenant and a pod runs whatever image its InferenceService names, so
an answer is hostile until read: at most PARITY_MAX_BYTES or METRICS_MAX_BYTES are read (a larger
answer is an error, and the rest is never received), a compressed answer is refused rather than
inflated (a gzip bomb), a redirect is a failure, never followed (it would point the operator at any
address, and that address's answer would land in the service's status), and metrics pages are
parsed in a thread, so the event loop keeps serving every other service meanwhile. Which pods are
asked is decided by their owner chain (tandem.operator.observe), not by labels a pod can copy.
"""

from __future__ import annotations

import asyncio

import aiohttp
from tandem.operator.metrics import METRICS, failure_reason
from tandem.planning.autoscaling.snapshot import PodScrape, read_pod

METRICS_MAX_BYTES = 2 * 1024 * 1024  # a worker's or router's page is tens of KiB
CHUNK = 64 * 1024


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
    count_failures("metrics", [s.error for s, (*_, url) in zip(scrapes, pods, strict=True) if url is not None])
    return scrapes


def count_failures(kind: str, errors: list[str | None]) -> None:
    """tandem_operator_scrape_failures_total, by what was read and why it failed."""
    for error in errors:
        if error:
            METRICS.scrape_failures.labels(kind, failure_reason(error)).inc()


Page = tuple[str, str, bool, "str | None", "str | None"]  # name, role, ready, text, why no text


async def parse_pages(pages: list[Page]) -> list[PodScrape]:
    """Parses /metrics pages in a thread: up to METRICS_MAX_BYTES each, they must not stall the loop."""
    if not any(text for _, _, _, text, _ in pages):
        return [read_pod(*page) for page in pages]
    return await asyncio.to_thread(lambda: [read_pod(*page) for page in pages])
