"""KVTransferReady from the workers' KV health, as their routers report it: one test per reason, how
the routers' reports are combined, and the read's I/O."""

from __future__ import annotations

import asyncio
import socket

from aiohttp import web
from tandem.contracts.handoff_parity import PARITY_PATH, ParityReport
from tandem.contracts.kv_health import KVHealth, TransportInfo
from tandem.operator.config import OperatorConfig
from tandem.operator.handoff_condition import RouterParity
from tandem.operator.router_parity import read_routers, worker_health
from tandem.operator.spec import InferenceServiceSpec
from tandem.operator.status import (
    KVProbe,
    Observation,
    RoleObservation,
    compute_status,
    kv_condition,
)

TCP = InferenceServiceSpec.from_dict({"model": {"path": "/m"}, "kvTransfer": {"backend": "tcp"}})
RDMA = InferenceServiceSpec.from_dict({"model": {"path": "/m"}, "kvTransfer": {
    "backend": "nixl", "rdma": {"resourceName": "rdma/rdma_shared_device_a", "count": 1}}})


def _health(backend="tcp", healthy=True, rdma=False, network="tcp", **extra) -> KVHealth:
    transport = TransportInfo(rdma=rdma, network=network, detected_by="test",
                              reason="no RDMA device in /sys/class/infiniband")
    return KVHealth(backend=backend, healthy=healthy, transport=transport, **extra)


def test_not_probed_when_probing_is_off():
    c = kv_condition(TCP, None)
    assert (c["status"], c["reason"]) == ("Unknown", "NotProbed")


def test_no_workers_when_no_pod_is_ready():
    c = kv_condition(TCP, [])
    assert (c["status"], c["reason"]) == ("Unknown", "NoWorkers")


def test_healthy_says_the_transport_in_use():
    probes = [KVProbe(f"svc-{r}-{i}", r, _health()) for r in ("prefill", "decode") for i in range(2)]
    c = kv_condition(TCP, probes)
    assert (c["status"], c["reason"], c["message"]) == ("True", "Healthy", "4 workers report tcp over tcp")
    rdma = [KVProbe("p", "prefill", _health("nixl", rdma=True, network="rdma"))]
    assert kv_condition(RDMA, rdma)["message"] == "1 worker reports nixl over rdma"


def test_rdma_fallback_names_the_pod_and_the_workers_reason():
    probes = [KVProbe("svc-prefill-a", "prefill", _health("nixl", rdma=True, network="rdma")),
              KVProbe("svc-decode-b", "decode", _health("nixl"))]
    c = kv_condition(RDMA, probes)
    assert (c["status"], c["reason"]) == ("False", "RDMAFallback")
    assert "svc-decode-b" in c["message"] and "svc-prefill-a" not in c["message"]
    assert "no RDMA device in /sys/class/infiniband" in c["message"]
    # without kvTransfer.rdma, TCP is what was asked for
    assert kv_condition(TCP, probes[1:])["reason"] == "Healthy"
    # without a spec the operator can read, nobody asked for RDMA either
    assert kv_condition(None, probes[1:])["reason"] == "Healthy"


def test_transfer_failing_wins_and_names_the_pod():
    bad = _health(healthy=False, failures_total={"pull": 3}, last_error="peer 127.50.0.3:41000 refused")
    probes = [KVProbe("svc-decode-b", "decode", bad), KVProbe("svc-prefill-a", "prefill", error="timed out")]
    c = kv_condition(RDMA, probes)
    assert (c["status"], c["reason"]) == ("False", "TransferFailing")
    assert "svc-decode-b" in c["message"] and "3 failed transfers" in c["message"]
    assert "peer 127.50.0.3:41000 refused" in c["message"]


def test_unreachable_names_the_pod():
    probes = [KVProbe("svc-prefill-a", "prefill", _health()), KVProbe("svc-decode-b", "decode", error="refused")]
    c = kv_condition(TCP, probes)
    assert (c["status"], c["reason"]) == ("Unknown", "Unreachable")
    assert "svc-decode-b" in c["message"] and "refused" in c["message"]
    # a worker still loading its model answers, but has no transport to judge yet
    loading = [KVProbe("svc-decode-b", "decode", KVHealth(backend="none"))]
    c = kv_condition(TCP, loading)
    assert (c["reason"], "svc-decode-b" in c["message"]) == ("Unreachable", True)


def test_kv_transfer_ready_does_not_change_ready():
    obs = Observation(roles={r: RoleObservation(exists=True, replicas=1, ready=1)
                             for r in ("prefill", "decode", "router")}, router_service=True,
                      kv_probes=[KVProbe("p", "prefill", _health(healthy=False))])
    st = compute_status(TCP, obs, None, "2026-01-01T00:00:00Z", 1, "http://x", "g")
    by_type = {c["type"]: c for c in st["conditions"]}
    assert by_type["KVTransferReady"]["reason"] == "TransferFailing"
    assert by_type["Ready"]["status"] == "True"


def _pod(name, role, ip, ready=True, port=8000):
    return {"metadata": {"name": name},
            "spec": {"containers": [{"name": "worker", "ports": [{"name": "http", "containerPort": port}]}]},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def _report(health: dict | None = None, unreachable: dict | None = None) -> ParityReport:
    return ParityReport(enabled=True, kv_health=health or {}, unreachable=unreachable or {})


OBS = Observation(roles={
    "prefill": RoleObservation(pods=[_pod("p-a", "prefill", "127.50.0.2"),
                                     _pod("p-b", "prefill", "127.50.0.3", ready=False)]),
    "decode": RoleObservation(pods=[_pod("d-a", "decode", "127.50.0.4", port=9000),
                                    _pod("d-b", "decode", "127.50.0.6")]),
    "router": RoleObservation(pods=[_pod("r-a", "router", "127.50.0.5")]),
})


def test_worker_health_comes_from_the_routers_reports_of_owned_ready_pods():
    """Each ready worker pod's health is what a router reported under its URL; a pod still starting
    is not judged; a URL no owned pod has (a copied-label impostor the router found) is ignored."""
    ok, bad = _health(), _health(healthy=False, failures_total={"pull": 2}, last_error="refused")
    report = _report({"http://127.50.0.2:8000": ok, "http://127.50.0.4:9000": ok,
                      "http://127.50.0.3:8000": bad, "http://127.50.0.99:8000": bad},
                     {"http://127.50.0.6:8000": "connection refused"})
    got = worker_health(OBS, [RouterParity("r-a", report)])
    assert [(p.pod, p.role) for p in got] == [("d-a", "decode"), ("d-b", "decode"), ("p-a", "prefill")]
    by_pod = {p.pod: p for p in got}
    assert by_pod["p-a"].health is ok and by_pod["d-a"].health is ok
    assert by_pod["d-b"].health is None and by_pod["d-b"].error == "its router cannot reach it: connection refused"
    c = kv_condition(TCP, got)
    assert (c["reason"], "d-b" in c["message"], "127.50.0.99" in c["message"]) == ("Unreachable", True, False)


def test_the_unhealthy_report_wins_when_routers_disagree():
    ok, bad = _health(), _health(healthy=False, failures_total={"pull": 1}, last_error="peer gone")
    one = {"http://127.50.0.2:8000": ok, "http://127.50.0.4:9000": ok, "http://127.50.0.6:8000": ok}
    two = dict(one) | {"http://127.50.0.4:9000": bad}
    for order in ([RouterParity("r-a", _report(one)), RouterParity("r-b", _report(two))],
                  [RouterParity("r-b", _report(two)), RouterParity("r-a", _report(one))]):
        c = kv_condition(TCP, worker_health(OBS, order))
        assert (c["reason"], "d-a" in c["message"], "peer gone" in c["message"]) == ("TransferFailing", True, True)


def test_a_worker_no_router_reports_says_why():
    assert worker_health(OBS, None) is None  # --no-kv-probe: routers not read
    assert {p.error for p in worker_health(OBS, [])} == {"no router pod is ready to report it"}
    unread = worker_health(OBS, [RouterParity("r-a", error="HTTP 302 from http://x: a redirect")])
    assert {p.error for p in unread} == {"no router report names it (router pod r-a: HTTP 302 from http://x: a redirect)"}
    fresh = worker_health(OBS, [RouterParity("r-a", _report())])
    assert {p.error for p in fresh} == {"no router has polled it yet"}


async def _serve(ip: str, handler) -> tuple[web.AppRunner, int]:
    """A router's report served by `handler` at ip, on a free port: (its runner, the port)."""
    app = web.Application()
    app.router.add_get(PARITY_PATH, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, ip, 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


async def test_routers_are_read_concurrently_and_a_failure_says_why():
    report = _report({"http://127.50.0.2:8000": _health()}).to_dict()

    async def parity(_):
        return web.json_response(report)

    async def slow(_):
        await asyncio.sleep(2.5)
        return web.json_response(report)

    runner, port = await _serve("127.0.0.1", parity)
    slow_runner, slow_port = await _serve("127.0.0.2", slow)
    with socket.socket() as s:
        s.bind(("127.0.0.3", 0))
        closed = s.getsockname()[1]
    obs = Observation(roles={"router": RoleObservation(pods=[
        _pod("ok", "router", "127.0.0.1", port=port), _pod("slow", "router", "127.0.0.2", port=slow_port),
        _pod("gone", "router", "127.0.0.3", port=closed)])})
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        got = await read_routers(obs, OperatorConfig(kv_probe_timeout_s=1.0))
        assert loop.time() - t0 < 3
    finally:
        await runner.cleanup()
        await slow_runner.cleanup()
    by_pod = {r.pod: r for r in got}
    assert by_pod["ok"].report.kv_health["http://127.50.0.2:8000"].healthy is True and by_pod["ok"].error is None
    assert by_pod["slow"].report is None and "in time" in by_pod["slow"].error
    assert by_pod["gone"].report is None and str(closed) in by_pod["gone"].error
