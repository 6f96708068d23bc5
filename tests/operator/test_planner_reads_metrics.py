"""The planner reads the router's and workers' own /metrics text (as their classes render it) into
typed readings, and two rounds of them into a snapshot over a window; what it cannot read stays
visible instead of reading as zero."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from tandem.planning.autoscaling.scrape import UnreadableMetrics, parse_router, parse_worker
from tandem.planning.autoscaling.snapshot import MetricsWindow, PodScrape, ScrapeRound, read_pod
from tandem.router.metrics import RouterMetrics
from tandem.worker.server.metrics import WorkerMetrics


class FakeEngine:
    """The attributes the worker's EngineCollector reads, settable by the test."""

    def __init__(self, running=0, waiting=0, leases=0, used=0, total=100, prompt=0, generated=0, outstanding=0):
        self.stats = SimpleNamespace(prompt_tokens_total=prompt, generation_tokens_total=generated,
                                     preemptions_total=0, steps_total=0, requests_finished={},
                                     prefill_tokens_computed_total=0, migrated_out={})
        self.num_running, self.num_waiting = running, waiting
        self.leases = dict.fromkeys(range(leases))
        self.allocator = SimpleNamespace(num_used=used, num_blocks=total)
        self.layout = SimpleNamespace(block_size=16, dtype="float32")
        self.outstanding = outstanding

    def outstanding_prompt_tokens(self) -> int:
        return self.outstanding


def text(registry) -> str:
    return generate_latest(registry).decode()


def test_worker_text_reads_into_typed_fields():
    eng = FakeEngine(running=3, waiting=1, leases=2, used=40, total=100, prompt=5000, generated=700,
                     outstanding=1234)
    m = WorkerMetrics(lambda: eng)
    m.observe_step(0.25, 512)
    m.observe_step(0.05, 3)
    r = parse_worker(text(m.registry))
    assert (r.running, r.waiting, r.leased, r.kv_blocks_used, r.kv_blocks_total) == (3, 1, 2, 40, 100)
    assert (r.prompt_tokens, r.generation_tokens) == (5000, 700)
    assert math.isclose(r.busy_seconds, 0.3) and r.steps == 2 and r.step_tokens == 515
    assert r.outstanding_prompt_tokens == 1234


def test_a_worker_without_the_outstanding_prompt_gauge_reads_as_unknown_not_zero():
    """Workers older than the gauge: the planner goes without the prefill backlog."""
    m = WorkerMetrics(lambda: FakeEngine(outstanding=99))
    older = "\n".join(line for line in text(m.registry).splitlines() if "outstanding_prompt" not in line)
    assert parse_worker(older + "\n").outstanding_prompt_tokens is None


def test_a_worker_still_loading_its_model_is_unreadable_not_idle():
    m = WorkerMetrics(lambda: None)
    with pytest.raises(UnreadableMetrics, match="still be loading"):
        parse_worker(text(m.registry))
    pod = read_pod("d-0", "decode", True, text(m.registry))
    assert pod.reading is None and "tandem_worker_running_sequences" in pod.error


def test_garbage_and_missing_answers_are_unreadable():
    assert "not Prometheus text" in read_pod("r", "router", True, "<html>502 Bad Gateway</html>\n").error
    assert read_pod("r", "router", True, None, "connection refused").error == "connection refused"
    with pytest.raises(UnreadableMetrics, match="tandem_time_to_first_token_seconds"):
        parse_router("tandem_requests_in_flight 3\n")


def _rounds(*texts_at: tuple[float, list[PodScrape]]) -> MetricsWindow:
    w = MetricsWindow(60.0)
    for t, pods in texts_at:
        w = w.add(ScrapeRound(t, tuple(pods)))
    return w


def test_percentiles_are_over_the_window_not_since_the_router_started():
    m = RouterMetrics()
    for _ in range(1000):
        m.ttft.observe(0.03)  # a fast past
    before = read_pod("router-0", "router", True, text(m.registry))
    for _ in range(100):
        m.ttft.observe(3.0)  # a slow window
    for _ in range(100):
        m.itl.observe(0.15)
    m.in_flight.set(7)
    m.requests.labels("200").inc(100)
    m.routes.labels("disaggregated").inc(80)
    m.routes.labels("short_prompt").inc(20)
    after = read_pod("router-0", "router", True, text(m.registry))
    snap = _rounds((0.0, [before]), (60.0, [after])).snapshot()
    r = snap.router
    assert r.ttft.count == 100 and 2.0 < r.ttft.quantile(0.5) <= 5.0
    assert parse_router(text(m.registry)).ttft.quantile(0.5) < 0.05, "since start, the past dominates"
    assert r.in_flight == 7 and math.isclose(r.request_rate, 100 / 60)
    assert math.isclose(r.route_rates["disaggregated"], 80 / 60)


def test_a_restarted_router_counts_from_zero_and_two_routers_add_up():
    old, new, other = RouterMetrics(), RouterMetrics(), RouterMetrics()
    for _ in range(500):
        old.itl.observe(0.01)
    for m in (new, other):
        for _ in range(50):
            m.itl.observe(0.3)
    first = [read_pod("router-0", "router", True, text(old.registry)),
             read_pod("router-1", "router", True, text(other.registry))]
    for _ in range(50):
        other.itl.observe(0.3)
    second = [read_pod("router-0", "router", True, text(new.registry)),  # restarted: counts went down
              read_pod("router-1", "router", True, text(other.registry))]
    snap = _rounds((0.0, first), (60.0, second)).snapshot()
    assert snap.router.itl.count == 100 and snap.router.readable == 2
    assert 0.2 < snap.router.itl.quantile(0.9) <= 0.5


def _worker(name: str, role: str, ready: bool = True, **kw) -> PodScrape:
    eng = FakeEngine(**{k: v for k, v in kw.items() if k != "busy"})
    m = WorkerMetrics(lambda: eng)
    if kw.get("busy"):
        m.observe_step(kw["busy"], 100)
    return read_pod(name, role, ready, text(m.registry))


def test_role_window_rates_sums_and_what_could_not_be_read():
    t0 = [_worker("p-0", "prefill", prompt=0), _worker("d-0", "decode", running=2, used=10, prompt=0, generated=0),
          read_pod("router-0", "router", True, text(RouterMetrics().registry))]
    t1 = [_worker("p-0", "prefill", prompt=6000, busy=45.0, waiting=1),
          _worker("p-1", "prefill", prompt=100, busy=1.0),  # new: gauges count, no rate yet
          _worker("d-0", "decode", running=4, used=30, total=100, prompt=6000, generated=1200),
          read_pod("d-1", "decode", True, None, "timed out"),
          read_pod("d-2", "decode", False, None, "no IP yet"),
          read_pod("router-0", "router", True, text(RouterMetrics().registry))]
    snap = _rounds((0.0, t0), (60.0, t1)).snapshot()
    pre, dec = snap.roles["prefill"], snap.roles["decode"]
    assert (pre.ready, pre.readable, pre.rated) == (2, 2, 1)
    assert math.isclose(pre.prompt_tokens_rate, 100.0) and math.isclose(pre.busy, 0.75) and pre.waiting == 1
    assert math.isclose(pre.step_tokens_rate, 100 / 60), "tokens the steps processed, apart from those added"
    assert (dec.ready, dec.readable, dec.unreadable) == (2, 1, 1)
    assert dec.running == 4 and math.isclose(dec.kv_usage, 0.3) and math.isclose(dec.generation_tokens_rate, 20.0)
    assert dec.outstanding_prompt_tokens == 0 and pre.outstanding_prompt_tokens == 0
    assert snap.problems == ("decode pod d-1: timed out",), "a pod not ready yet is no problem"
    assert [p.name for p in dec.pods] == ["d-0", "d-1", "d-2"], "every pod is listed, read or not"


def test_no_router_means_no_latency_and_says_so():
    t = [_worker("d-0", "decode"), read_pod("router-0", "router", True, None, "connection refused")]
    snap = _rounds((0.0, t), (15.0, t)).snapshot()
    assert snap.router is None
    assert snap.problems == ("router router-0: connection refused",)


def test_the_window_keeps_just_enough_rounds():
    t = [_worker("d-0", "decode")]
    w = _rounds(*[(15.0 * i, t) for i in range(10)])  # 0 .. 135 s
    assert [r.time for r in w.rounds] == [75.0, 90.0, 105.0, 120.0, 135.0]
    assert w.snapshot().window_s == 60.0
    assert _rounds((0.0, t), (15.0, t)).snapshot().window_s == 15.0, "young history: the window it has"
    assert _rounds((0.0, t)).snapshot().window_s is None


def test_a_vllm_page_without_what_the_planner_needs_names_what_is_missing():
    """A vLLM server is told apart by its own series; a page of it lacking the counters the planner
    reads is unreadable with their names, not read as a Tandem worker still loading (the full page
    of a real server: tests/vllm/test_the_planner_reads_a_real_vllm_pair.py)."""
    with pytest.raises(UnreadableMetrics, match="vLLM metrics lack .*vllm:request_prefill_time_seconds_sum"):
        parse_worker("vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n")
