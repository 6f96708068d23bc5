"""The operator's own HTTP endpoints, on the --liveness address: the liveness path (200 while the
process's event loop runs, standby or leader) and /metrics (Prometheus text).

Served by the operator itself rather than by kopf's liveness endpoint, so a standby replica, which
does not run kopf until it leads, answers the kubelet's probe and exposes its metrics too.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

METRICS_PATH = "/metrics"


def _app(health_path: str, registry: CollectorRegistry) -> web.Application:
    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get(health_path, health)
    if health_path != METRICS_PATH:
        app.router.add_get(METRICS_PATH, metrics)
    return app


async def serve(url: str, registry: CollectorRegistry = REGISTRY) -> web.AppRunner:
    """Starts the endpoints at `url` (e.g. http://0.0.0.0:8080/healthz); stop with runner.cleanup()."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.port:
        raise ValueError(f"--liveness {url}: expected http://HOST:PORT/PATH")
    runner = web.AppRunner(_app(parts.path or "/healthz", registry), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, parts.hostname or "0.0.0.0", parts.port).start()
    return runner
