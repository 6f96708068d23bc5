"""KVTransferReady from the workers' /internal/kv/health answers: one test per reason, and the probe's I/O."""

from __future__ import annotations

import asyncio
import socket

from aiohttp import web
from tandem.contracts.kv_health import KVHealth, TransportInfo
from tandem.operator.probe import HEALTH_PATH, Target, probe_all, targets
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


def test_targets_are_the_ready_worker_pods():
    obs = Observation(roles={
        "prefill": RoleObservation(pods=[_pod("p-a", "prefill", "127.50.0.2"),
                                         _pod("p-b", "prefill", "127.50.0.3", ready=False)]),
        "decode": RoleObservation(pods=[_pod("d-a", "decode", "127.50.0.4", port=9000)]),
        "router": RoleObservation(pods=[_pod("r-a", "router", "127.50.0.5")]),
    })
    assert targets(obs) == [
        Target("d-a", "decode", f"http://127.50.0.4:9000{HEALTH_PATH}"),
        Target("p-a", "prefill", f"http://127.50.0.2:8000{HEALTH_PATH}"),
    ]


async def test_probe_all_reports_answers_and_failures_concurrently():
    async def health(_):
        return web.json_response(_health().to_dict())

    async def slow(_):
        await asyncio.sleep(5)
        return web.json_response(_health().to_dict())

    app = web.Application()
    app.router.add_get(HEALTH_PATH, health)
    app.router.add_get("/slow" + HEALTH_PATH, slow)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        got = await probe_all([
            Target("ok", "prefill", f"http://127.0.0.1:{port}{HEALTH_PATH}"),
            Target("slow", "decode", f"http://127.0.0.1:{port}/slow{HEALTH_PATH}"),
            Target("gone", "decode", f"http://127.0.0.1:{closed}{HEALTH_PATH}"),
        ], timeout_s=1.0)
        assert loop.time() - t0 < 3
    finally:
        await runner.cleanup()
    by_pod = {p.pod: p for p in got}
    assert by_pod["ok"].health.healthy is True and by_pod["ok"].error is None
    assert by_pod["slow"].health is None and "in time" in by_pod["slow"].error
    assert by_pod["gone"].health is None and str(closed) in by_pod["gone"].error
