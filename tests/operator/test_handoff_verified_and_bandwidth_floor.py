"""HandoffVerified from the routers' parity reports, and KVTransferReady's bandwidth floor
(spec.kvTransfer.minBandwidthGBps), as plain function calls: one test per reason, and the
operator's read of the routers' reports over HTTP (bounded, hostile answers refused)."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from tandem.contracts.handoff_parity import (
    ParityReport,
    ParityState,
    ProbeOutcome,
    ProbeResult,
    WorkerParity,
)
from tandem.contracts.kv_health import KVHealth, TransportInfo
from tandem.operator.config import OperatorConfig
from tandem.operator.handoff_condition import RouterParity, handoff_condition
from tandem.operator.kv_bandwidth import about
from tandem.operator.router_parity import read_routers
from tandem.operator.spec import InferenceServiceSpec
from tandem.operator.status import (
    KVProbe,
    Observation,
    RoleObservation,
    compute_conditions,
    kv_condition,
)
from tandem.testing.cluster import free_port


def pod(name: str, role: str, ip: str, ready: bool = True) -> dict:
    return {"metadata": {"name": name, "labels": {"tandem.dev/role": role}},
            "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8000}]}]},
            "status": {"podIP": ip, "phase": "Running",
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def observation(router_ip: str = "10.0.0.9") -> Observation:
    return Observation(roles={
        "prefill": RoleObservation(True, 1, 1, [pod("svc-prefill-a", "prefill", "10.0.0.1")]),
        "decode": RoleObservation(True, 2, 2, [pod("svc-decode-b", "decode", "10.0.0.2"),
                                               pod("svc-decode-c", "decode", "10.0.0.3")]),
        "router": RoleObservation(True, 1, 1, [pod("svc-router-r", "router", router_ip)]),
    })


KIND = web.AppKey("kind", str)
P, B, C = "http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"


def worker(url: str, role: str, state: ParityState, diff: float | None = 0.0,
           message: str = "max |logprob difference| 0 over 8 tokens (tolerance 0.0001)") -> WorkerParity:
    outcome = {ParityState.VERIFIED: ProbeOutcome.MATCH, ParityState.MISMATCH: ProbeOutcome.MISMATCH}.get(
        state, ProbeOutcome.ERROR)
    last = None if state is ParityState.UNCHECKED else ProbeResult(P, B, "g1", outcome, diff, 1e-4, "float32", 8,
                                                                   message)
    return WorkerParity(url, role, "g1", state, last=last)


def read(*workers: WorkerParity, enabled: bool = True) -> RouterParity:
    return RouterParity("svc-router-r", ParityReport(enabled, list(workers)))


ALL_VERIFIED = (worker(P, "prefill", ParityState.VERIFIED), worker(B, "decode", ParityState.VERIFIED),
                worker(C, "decode", ParityState.VERIFIED))


def test_verified_when_every_ready_worker_is_proven():
    c = handoff_condition(observation(), [read(*ALL_VERIFIED)])
    assert (c["type"], c["status"], c["reason"]) == ("HandoffVerified", "True", "Verified")
    assert "3 workers proven" in c["message"] and "largest |logprob difference| 0" in c["message"]
    assert "0.0001 for float32" in c["message"]


def test_a_mismatch_names_the_pod_and_the_measured_difference():
    bad = worker(C, "decode", ParityState.MISMATCH, 1.93, "max |logprob difference| 1.93 over 8 tokens "
                 "(tolerance 0.0001); first at continuation token 0")
    c = handoff_condition(observation(), [read(*ALL_VERIFIED[:2], bad)])
    assert (c["status"], c["reason"]) == ("False", "ParityMismatch")
    assert "pod svc-decode-c (decode)" in c["message"] and "1.93" in c["message"]
    assert "svc-decode-b" not in c["message"] and "prefilled on the decode pool" in c["message"]


def test_the_worst_standing_over_the_routers_wins():
    other = RouterParity("svc-router-s", ParityReport(True, [worker(B, "decode", ParityState.MISMATCH, 3.0)]))
    c = handoff_condition(observation(), [read(*ALL_VERIFIED), other])
    assert (c["reason"], "svc-decode-b" in c["message"]) == ("ParityMismatch", True)


def test_unknown_while_checking_failing_unreadable_or_not_probing():
    obs = observation()
    waiting = handoff_condition(obs, [read(*ALL_VERIFIED[:2], worker(C, "decode", ParityState.UNCHECKED))])
    assert (waiting["status"], waiting["reason"]) == ("Unknown", "Checking") and "svc-decode-c" in waiting["message"]
    missing = handoff_condition(obs, [read(*ALL_VERIFIED[:2])])  # the router has not seen the pod yet
    assert missing["reason"] == "Checking"
    failed = handoff_condition(obs, [read(*ALL_VERIFIED[:2], worker(C, "decode", ParityState.FAILED, None,
                                                                   "generate on x returned 503"))])
    assert (failed["reason"], "returned 503" in failed["message"]) == ("ProbeFailed", True)
    unread = handoff_condition(obs, [read(*ALL_VERIFIED), RouterParity("svc-router-s", error="timed out")])
    assert (unread["reason"], "svc-router-s: timed out" in unread["message"]) == ("Unreachable", True)
    assert handoff_condition(obs, None)["reason"] == "NotProbed"
    assert handoff_condition(obs, [])["reason"] == "NoRouters"
    assert handoff_condition(obs, [read(enabled=False)])["reason"] == "NotProbed"


def test_only_ready_pods_count_and_no_prefill_pod_is_no_pairing():
    obs = observation()
    obs.roles["decode"].pods[1] = pod("svc-decode-c", "decode", "10.0.0.3", ready=False)
    c = handoff_condition(obs, [read(*ALL_VERIFIED[:2], worker(C, "decode", ParityState.MISMATCH, 5.0))])
    assert c["reason"] == "Verified", "a pod that is not ready is not held against the service"
    obs.roles["prefill"].pods = []
    c = handoff_condition(obs, [read(worker(B, "decode", ParityState.UNCHECKED))])
    assert (c["status"], c["reason"]) == ("Unknown", "NoPairing")


def test_handoff_verified_is_among_the_conditions_and_does_not_feed_ready():
    obs = observation()
    obs.parity = [read(*ALL_VERIFIED[:2], worker(C, "decode", ParityState.MISMATCH, 2.0))]
    conditions = {c["type"]: c for c in compute_conditions(None, obs)}
    assert conditions["HandoffVerified"]["reason"] == "ParityMismatch"
    assert conditions["Ready"]["status"] == "True"


# --- the bandwidth floor ----------------------------------------------------------------------

FLOOR = InferenceServiceSpec.from_dict({"model": {"path": "/m"}, "kvTransfer": {"backend": "tcp",
                                                                                "minBandwidthGBps": 1.0}})
NO_FLOOR = InferenceServiceSpec.from_dict({"model": {"path": "/m"}, "kvTransfer": {"backend": "tcp"}})


def _probe(name: str, role: str, bytes_per_s: float | None, transfers: int = 32) -> KVProbe:
    transport = TransportInfo(rdma=False, network="tcp", detected_by="test")
    return KVProbe(name, role, KVHealth(backend="tcp", healthy=True, transport=transport,
                                        recent_bandwidth_bytes_per_second=bytes_per_s,
                                        recent_transfers=transfers if bytes_per_s else 0))


def test_a_worker_below_the_floor_turns_kv_transfer_false_with_the_figure_and_the_causes():
    probes = [_probe("svc-prefill-a", "prefill", 4.2e9), _probe("svc-decode-b", "decode", 0.35e9, 17)]
    c = kv_condition(FLOOR, probes)
    assert (c["status"], c["reason"]) == ("False", "BandwidthBelowFloor")
    assert "pod svc-decode-b (decode) moves KV over tcp over tcp at ~0.32 GB/s (last 17 transfers)" in c["message"]
    assert "minBandwidthGBps 1" in c["message"] and "svc-prefill-a" not in c["message"]
    assert "UCX_IB_ADDR_TYPE" in c["message"] and "bonded" in c["message"] and "fell back to TCP" in c["message"]


def test_above_the_floor_or_without_one_it_is_healthy_and_says_what_was_measured():
    probes = [_probe("svc-prefill-a", "prefill", None), _probe("svc-decode-b", "decode", 1.7e9)]
    for spec in (FLOOR, NO_FLOOR):
        c = kv_condition(spec, probes)
        assert (c["status"], c["reason"]) == ("True", "Healthy")
        assert c["message"] == ("2 workers report tcp over tcp; KV handoffs measured: tcp over tcp ~1.6 GB/s "
                                "(slowest of 1)")
    slow_no_floor = kv_condition(NO_FLOOR, [_probe("svc-decode-b", "decode", 1e6)])
    assert slow_no_floor["reason"] == "Healthy", "no floor, no judgement"


def test_figures_are_rounded_down_to_steps_so_status_settles():
    assert [about(x) for x in (1.0, 1.2, 1.3, 1.585, 1.6, 9.99, 0.00021, 42.6)] == [
        "1 GB/s", "1 GB/s", "1.3 GB/s", "1.6 GB/s", "1.6 GB/s", "7.9 GB/s", "0.0002 GB/s", "40 GB/s"]


def test_the_floor_is_refused_at_parse_time_when_not_positive():
    from tandem.operator.spec import SpecError

    with pytest.raises(SpecError, match="minBandwidthGBps"):
        InferenceServiceSpec.from_dict({"model": {"path": "/m"}, "kvTransfer": {"minBandwidthGBps": 0}})


# --- reading the routers' reports ------------------------------------------------------------


def test_reports_are_read_from_ready_routers_and_junk_is_refused():
    async def main() -> list[RouterParity] | None:
        answers = {"good": read(*ALL_VERIFIED).report.to_dict(), "junk": {"hello": 1}}

        async def handler(request: web.Request) -> web.Response:
            kind = request.app[KIND]
            if kind == "huge":
                return web.Response(body=b"x" * (300 * 1024), content_type="application/json")
            return web.json_response(answers[kind])

        runners, routers = [], []
        for kind in ("good", "junk", "huge"):
            app = web.Application()
            app[KIND] = kind
            app.router.add_get("/internal/parity", handler)
            runner = web.AppRunner(app)
            await runner.setup()
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            runners.append(runner)
            p = pod(f"svc-router-{kind}", "router", "127.0.0.1")
            p["spec"]["containers"][0]["ports"][0]["containerPort"] = port
            routers.append(p)
        obs = Observation(roles={"router": RoleObservation(True, 3, 3, routers)})
        try:
            return await read_routers(obs, OperatorConfig(kv_probe_timeout_s=5))
        finally:
            for r in runners:
                await r.cleanup()

    reads = {r.pod: r for r in asyncio.run(main())}
    assert json.dumps(reads["svc-router-good"].report.to_dict()) == json.dumps(read(*ALL_VERIFIED).report.to_dict())
    assert "no parity report" in reads["svc-router-junk"].error
    assert "more than" in reads["svc-router-huge"].error
    assert asyncio.run(read_routers(Observation(), OperatorConfig(kv_probe=False))) is None
