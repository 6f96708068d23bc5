"""The operator's planner sizes a vLLM service from vLLM's own /metrics (issue 29 item 4: "the planner
and autoscaling read vLLM's metrics"): two scrape rounds of a real vLLM prefill and decode server and
Tandem's router in front of them, as the operator takes them (planning/autoscaling: read_pod, the
window, plan), with real streams running between and during them.

What must hold: every page is readable (a vLLM page is not taken for a Tandem worker still loading);
the prefill pool's rates come from vLLM's counters (prompt tokens, engine steps, prefill time); the
decode pool's running sequences and KV blocks are vLLM's own (`vllm:cache_config_info`'s block
count); and with an ITL target no machine meets, the planner raises decode for that reason.
"""

from __future__ import annotations

import threading
import time
import urllib.request

import openai
import pytest
from tandem.operator.autoscaling.spec import AutoscalingSpec
from tandem.planning.autoscaling.planner import PlannerState, Reason, plan
from tandem.planning.autoscaling.scrape import VLLM_CACHE_INFO, WorkerReading
from tandem.planning.autoscaling.snapshot import MetricsWindow, ScrapeRound, read_pod

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROLES = ("router", "prefill", "decode")
STREAMS = 3
SPEC = AutoscalingSpec.from_dict({
    "targets": {"ttft": {"seconds": 30.0}, "itl": {"seconds": 0.00001}},  # an ITL no step meets
    "prefill": {"minReplicas": 1, "maxReplicas": 4},
    "decode": {"minReplicas": 1, "maxReplicas": 4},
})


def _page(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return r.read().decode()


def _round(servers) -> ScrapeRound:
    stamp = time.monotonic()
    return ScrapeRound(stamp, tuple(read_pod(role, role, True, _page(servers.url(role))) for role in ROLES))


def _num_gpu_blocks(text: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith(VLLM_CACHE_INFO + "{"))
    return float(line.split('num_gpu_blocks="')[1].split('"')[0])


def test_the_planner_sizes_a_vllm_pair_from_vllm_metrics(vllm_servers):
    servers = vllm_servers
    first = _round(servers)
    assert all(p.reading is not None for p in first.pods), [(p.name, p.error) for p in first.pods]
    assert all(isinstance(p.reading, WorkerReading) for p in first.pods if p.role != "router")

    api = openai.OpenAI(base_url=servers.url("router") + "/v1", api_key="unused", max_retries=0, timeout=300)
    errors: list[BaseException] = []

    def stream(i: int) -> None:
        try:
            prompt = f"Stream {i} asks the planner to count it. " * 12
            for _ in api.completions.create(model="toy", prompt=prompt, max_tokens=600, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}):
                pass
        except BaseException as e:  # noqa: BLE001 - reported by the test below
            errors.append(e)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while servers.metric("decode", "vllm:num_requests_running") < STREAMS:  # all prefilled and decoding
        assert time.monotonic() < deadline and not errors, errors or "the streams never all ran on decode"
        time.sleep(0.05)
    time.sleep(1.0)  # tokens for the router's ITL histogram
    second = _round(servers)
    decode_page = _page(servers.url("decode"))
    for t in threads:
        t.join()
    assert not errors, errors

    snap = MetricsWindow(600.0).add(first).add(second).snapshot()
    assert not snap.problems, snap.problems
    pre, dec = snap.roles["prefill"], snap.roles["decode"]
    assert pre.readable == 1 and dec.readable == 1
    assert pre.prompt_tokens_rate > 0 and pre.step_tokens_rate > 0 and pre.busy > 0
    assert dec.running >= 1  # a gauge: vLLM's running requests when the round was read
    assert dec.kv_blocks_total == _num_gpu_blocks(decode_page) and 0 < dec.kv_usage <= 1

    decision, _ = plan(snap, {"prefill": 1, "decode": 1}, SPEC, PlannerState(), time.monotonic())
    d = decision.roles["decode"]
    assert d.reason is Reason.ITL_ABOVE_TARGET and d.desired > 1, d
    assert decision.roles["prefill"].reason is not Reason.METRICS_UNAVAILABLE, decision.roles["prefill"]
