"""Routing choices: load balancing, conditional disaggregation, fallback and generation pairing."""

from __future__ import annotations

from tandem.contracts.names import Role
from tandem.worker.router.policy import (
    WorkerView,
    choose,
    choose_decode,
    choose_prefill,
    estimate_tokens,
    pick_generation,
)


def P(url, **kw):
    kw.setdefault("ready", True)
    return WorkerView(url=url, role=Role.PREFILL, generation=kw.pop("gen", "g1"), **kw)


def D(url, **kw):
    kw.setdefault("ready", True)
    return WorkerView(url=url, role=Role.DECODE, generation=kw.pop("gen", "g1"), **kw)


def test_prefill_by_least_outstanding_prompt_tokens_decode_by_least_running():
    ws = [P("p1", outstanding_prompt_tokens=500), P("p2", outstanding_prompt_tokens=100, router_prompt_tokens=50),
          D("d1", running=3), D("d2", running=1, kv_usage=0.9), D("d3", running=1, kv_usage=0.1)]
    plan = choose(ws, prompt_chars=4000, short_prompt_threshold=0)
    assert plan.prefill.url == "p2" and plan.decode.url == "d3" and plan.reason == "disaggregated"


def test_router_side_inflight_counts_before_the_next_poll():
    ws = [D("d1", running=0, router_inflight=2), D("d2", running=1)]
    assert choose_decode(ws).url == "d2"


def test_short_prompts_skip_prefill():
    ws = [P("p1"), D("d1")]
    assert estimate_tokens(40) == 10
    plan = choose(ws, prompt_chars=40, short_prompt_threshold=11)
    assert plan.prefill is None and plan.reason == "short prompt"
    assert choose(ws, prompt_chars=44, short_prompt_threshold=11).prefill.url == "p1"


def test_no_ready_prefill_falls_back_to_decode_side_prefill():
    plan = choose([P("p1", ready=False), D("d1")], prompt_chars=4000, short_prompt_threshold=0)
    assert plan.prefill is None and plan.decode.url == "d1" and plan.reason == "no prefill worker"


def test_no_decode_capable_worker_means_no_plan():
    assert choose([P("p1"), D("d1", ready=False)], 100, 0) is None
    assert choose([], 100, 0) is None


def test_excluded_workers_are_not_chosen():
    ws = [D("d1"), D("d2", running=5)]
    assert choose_decode(ws, frozenset({"d1"})).url == "d2"
    assert choose_decode(ws, frozenset({"d1", "d2"})) is None
    assert choose_prefill([P("p1"), P("p2", gen="g2")], "g1", frozenset({"p1"})) is None


def test_colocated_serves_decode_side_but_pure_decode_is_preferred_for_handoff():
    ws = [P("p1"), WorkerView("c1", Role.COLOCATED, ready=True, generation="g1"), D("d1", running=9)]
    assert choose(ws, 4000, 0).decode.url == "d1"
    assert choose([WorkerView("c1", Role.COLOCATED, ready=True)], 4000, 0).decode.url == "c1"


def test_only_the_same_generation_is_paired_newest_first():
    ws = [P("p-old", gen="old", first_seen=1), D("d-old", gen="old", first_seen=1),
          P("p-new", gen="new", first_seen=5), D("d-new", gen="new", first_seen=6, running=0),
          D("d-old2", gen="old", first_seen=2, running=0)]
    assert pick_generation([w for w in ws if w.role is Role.PREFILL], [w for w in ws if w.role is Role.DECODE]) == "new"
    plan = choose(ws, 4000, 0)
    assert (plan.prefill.url, plan.decode.url) == ("p-new", "d-new")


def test_generation_without_a_partner_is_not_paired():
    # new prefill is up but no new decode yet: stay on the old generation
    ws = [P("p-new", gen="new", first_seen=9), P("p-old", gen="old"), D("d-old", gen="old")]
    plan = choose(ws, 4000, 0)
    assert (plan.prefill.url, plan.decode.url) == ("p-old", "d-old")
    # nothing pairs at all: decode-side prefill rather than a mismatched pair
    plan = choose([P("p-new", gen="new"), D("d-old", gen="old")], 4000, 0)
    assert plan.prefill is None and plan.reason == "no matching generation"
