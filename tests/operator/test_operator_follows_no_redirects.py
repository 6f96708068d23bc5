"""The operator follows no redirect from a pod (issue 28 item 8): a tenant's pod that answers the
metrics scrape or the router report's read (handoff parity and the workers' KV health) with a 3xx could otherwise point the shared
operator at any address it can reach, and that address's answer would land in the service's status.
A redirect is a failure that says so, and the address it names is never asked. Real HTTP servers on
loopback, no cluster."""

from __future__ import annotations

import pytest
from aiohttp import web
from tandem.contracts.handoff_parity import PARITY_PATH, ParityReport
from tandem.contracts.kv_health import KVHealth
from tandem.operator.config import OperatorConfig
from tandem.operator.metrics import METRICS
from tandem.operator.probe import read_metrics
from tandem.operator.router_parity import read_routers
from tandem.operator.status import Observation, RoleObservation
from tandem.testing.pod_http import worker_metrics

HEALTHY = KVHealth(backend="tcp", healthy=True)
WORKER = "http://127.50.0.2:8000"  # a worker the healthy report vouches for


class Server:
    """One HTTP server on loopback; `hits` counts the requests it got, by path."""

    def __init__(self, app: web.Application) -> None:
        self.app, self.hits = app, []

        @web.middleware
        async def count(request: web.Request, handler):
            self.hits.append(request.path)
            return await handler(request)

        app.middlewares.append(count)

    async def __aenter__(self) -> str:
        self.runner = web.AppRunner(self.app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{self.port}"

    async def __aexit__(self, *_: object) -> None:
        await self.runner.cleanup()


def healthy_target() -> Server:
    """What an address elsewhere answers: everything the operator asks, healthy."""
    report = ParityReport(enabled=True, kv_health={WORKER: HEALTHY})
    answers = {"/metrics": lambda: web.Response(body=worker_metrics()),
               PARITY_PATH: lambda: web.json_response(report.to_dict())}

    async def answer(request: web.Request) -> web.Response:
        return answers[request.path]()

    app = web.Application()
    for path in answers:
        app.router.add_get(path, answer)
    return Server(app)


def redirecting_pod(to: str, status: int) -> Server:
    """A tenant's pod: every path redirected to the same path at `to`."""

    async def redirect(request: web.Request) -> web.Response:
        return web.Response(status=status, headers={"Location": to + request.path})

    app = web.Application()
    app.router.add_get("/{tail:.*}", redirect)
    return Server(app)


def router_pod(url: str) -> dict:
    port = int(url.rsplit(":", 1)[1])
    return {"metadata": {"name": "svc-router-r"},
            "spec": {"containers": [{"ports": [{"name": "http", "containerPort": port}]}]},
            "status": {"podIP": "127.0.0.1", "phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}


def redirect_failures(kind: str) -> float:
    return METRICS.scrape_failures.labels(kind, "redirect")._value.get()


async def test_the_healthy_address_answers_when_asked_directly():
    """The control: without the redirect, the same probes would count that address as healthy."""
    target = healthy_target()
    async with target as url:
        obs = Observation(roles={"router": RoleObservation(True, 1, 1, [router_pod(url)])})
        (parity,) = await read_routers(obs, OperatorConfig(kv_probe_timeout_s=5))
        (scrape,) = await read_metrics([("d-0", "decode", True, url + "/metrics")], timeout_s=5)
    assert parity.error is None and parity.report.kv_health[WORKER].healthy and scrape.error is None


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
async def test_a_redirecting_pod_fails_every_probe_and_the_target_is_never_asked(status):
    target = healthy_target()
    before = redirect_failures("router_report"), redirect_failures("metrics")
    async with target as elsewhere:
        pod = redirecting_pod(elsewhere, status)
        async with pod as url:
            (scrape,) = await read_metrics([("d-0", "decode", True, url + "/metrics")], timeout_s=5)
            obs = Observation(roles={"router": RoleObservation(True, 1, 1, [router_pod(url)])})
            (parity,) = await read_routers(obs, OperatorConfig(kv_probe_timeout_s=5))
    assert target.hits == [], f"the operator followed the redirect to {target.hits}"
    assert sorted(pod.hits) == sorted(["/metrics", PARITY_PATH])
    for error in (scrape.error, parity.error):
        assert f"HTTP {status} from {url}" in error and "does not follow" in error, error
        assert elsewhere not in error, "the redirect's target is not echoed into status"
    assert scrape.reading is None and parity.report is None
    assert redirect_failures("router_report") == before[0] + 1 and redirect_failures("metrics") == before[1] + 1
