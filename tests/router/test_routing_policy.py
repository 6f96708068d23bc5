"""Routing policies: load balancing, conditional disaggregation, fallback, kv_compat pairing, the
retry and resume targets, round-robin turns, and the registry that names them."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tandem.contracts.names import Role
from tandem.contracts.routing import RouteReason, RoutingPolicy
from tandem.router.policies.base import (
    PolicySettings,
    RequestInfo,
    Snapshot,
    WorkerView,
    estimate_tokens,
    pick_kv_compat,
)
from tandem.router.policies.least_loaded import LeastLoaded
from tandem.router.policies.registry import POLICIES, create_policy
from tandem.router.policies.round_robin import RoundRobin

LONG = RequestInfo("r", prompt_tokens=1000)


def P(url, **kw):
    kw.setdefault("ready", True)
    return WorkerView(url=url, role=Role.PREFILL, kv_compat=kw.pop("gen", "g1"), **kw)


def D(url, **kw):
    kw.setdefault("ready", True)
    return WorkerView(url=url, role=Role.DECODE, kv_compat=kw.pop("gen", "g1"), **kw)


def C(url, **kw):
    kw.setdefault("ready", True)
    return WorkerView(url=url, role=Role.COLOCATED, kv_compat=kw.pop("gen", "g1"), **kw)


def test_prefill_by_least_outstanding_prompt_tokens_decode_by_least_running():
    ws = [P("p1", outstanding_prompt_tokens=500), P("p2", outstanding_prompt_tokens=100, router_prompt_tokens=50),
          D("d1", running=3), D("d2", running=1, kv_usage=0.9), D("d3", running=1, kv_usage=0.1)]
    route = LeastLoaded().route(LONG, Snapshot(ws))
    assert (route.prefill.url, route.decode.url, route.reason) == ("p2", "d3", RouteReason.DISAGGREGATED)


def test_router_side_inflight_counts_before_the_next_poll():
    ws = [D("d1", running=0, router_inflight=2), D("d2", running=1)]
    assert LeastLoaded().resume_decode(LONG, Snapshot(ws), frozenset()).url == "d2"


def test_short_prompts_skip_prefill():
    policy = LeastLoaded(PolicySettings(short_prompt_threshold=11))
    ws = [P("p1"), D("d1")]
    assert estimate_tokens(40) == 10
    route = policy.route(RequestInfo("r", estimate_tokens(40)), Snapshot(ws))
    assert route.prefill is None and route.reason is RouteReason.SHORT_PROMPT
    assert policy.route(RequestInfo("r", estimate_tokens(44)), Snapshot(ws)).prefill.url == "p1"


def test_no_ready_prefill_falls_back_to_decode_side_prefill():
    route = LeastLoaded().route(LONG, Snapshot([P("p1", ready=False), D("d1")]))
    assert route.prefill is None and route.decode.url == "d1" and route.reason is RouteReason.NO_PREFILL_WORKER


def test_no_decode_capable_worker_means_no_plan():
    assert LeastLoaded().route(LONG, Snapshot([P("p1"), D("d1", ready=False)])) is None
    assert LeastLoaded().route(LONG, Snapshot([])) is None


def test_retry_and_resume_targets_skip_excluded_workers_and_keep_the_kv_compat():
    policy = LeastLoaded()
    ws = [P("p1"), P("p2", outstanding_prompt_tokens=900), P("p3", gen="g2"), D("d1"), D("d2", running=5)]
    route = policy.route(LONG, Snapshot(ws))
    assert route.prefill.url == "p1"
    assert policy.retry_prefill(LONG, route, Snapshot(ws), frozenset({"p1"})).url == "p2"
    assert policy.retry_prefill(LONG, route, Snapshot(ws), frozenset({"p1", "p2"})) is None  # p3 is another kv_compat
    assert policy.resume_decode(LONG, Snapshot(ws), frozenset({"d1"})).url == "d2"
    assert policy.resume_decode(LONG, Snapshot(ws), frozenset({"d1", "d2"})) is None
    assert policy.resume_decode(LONG, Snapshot([*ws, C("c1", ready=False)]), frozenset({"d1", "d2"})) is None


def test_colocated_serves_decode_side_but_pure_decode_is_preferred_for_handoff():
    assert LeastLoaded().route(LONG, Snapshot([P("p1"), C("c1"), D("d1", running=9)])).decode.url == "d1"
    assert LeastLoaded().route(LONG, Snapshot([C("c1")])).decode.url == "c1"


def test_only_the_same_kv_compat_is_paired_newest_first():
    ws = [P("p-old", gen="old", first_seen=1), D("d-old", gen="old", first_seen=1),
          P("p-new", gen="new", first_seen=5), D("d-new", gen="new", first_seen=6, running=0),
          D("d-old2", gen="old", first_seen=2, running=0)]
    assert pick_kv_compat([w for w in ws if w.role is Role.PREFILL], [w for w in ws if w.role is Role.DECODE]) == "new"
    route = LeastLoaded().route(LONG, Snapshot(ws))
    assert (route.prefill.url, route.decode.url) == ("p-new", "d-new")


def test_kv_compat_without_a_partner_is_not_paired():
    # new prefill is up but no new decode yet: stay on the old kv_compat
    route = LeastLoaded().route(LONG, Snapshot([P("p-new", gen="new", first_seen=9), P("p-old", gen="old"), D("d-old", gen="old")]))
    assert (route.prefill.url, route.decode.url) == ("p-old", "d-old")
    # nothing pairs at all: decode-side prefill rather than a mismatched pair
    route = LeastLoaded().route(LONG, Snapshot([P("p-new", gen="new"), D("d-old", gen="old")]))
    assert route.prefill is None and route.reason is RouteReason.NO_MATCHING_KV_COMPAT


def test_round_robin_takes_turns_whatever_the_load():
    policy = RoundRobin()
    ws = [P("p2"), P("p1", outstanding_prompt_tokens=10_000), D("d1"), D("d2", running=50), D("d3")]
    routes = [policy.route(LONG, Snapshot(ws, turns={Role.PREFILL: i, Role.DECODE: i})) for i in range(4)]
    assert [p.prefill.url for p in routes] == ["p1", "p2", "p1", "p2"]
    assert [p.decode.url for p in routes] == ["d1", "d2", "d3", "d1"]
    assert policy.resume_decode(LONG, Snapshot(ws, turns={Role.DECODE: 7}), frozenset({"d1", "d3"})).url == "d2"
    # the turn is the snapshot's: asking again over the same snapshot gives the same worker
    again = Snapshot(ws, turns={Role.PREFILL: 1, Role.DECODE: 2})
    assert {(p.prefill.url, p.decode.url) for p in (policy.route(LONG, again) for _ in range(3))} == {("p2", "d3")}
    # the shared rules hold for it too
    assert RoundRobin().route(LONG, Snapshot([P("p", gen="x"), D("d")])).reason is RouteReason.NO_MATCHING_KV_COMPAT


def test_route_reasons_are_single_words_safe_as_label_values():
    for reason in RouteReason:
        assert reason.value.replace("_", "").isalpha() and reason.value.islower()


def test_registry_names_every_policy_and_refuses_others():
    assert sorted(POLICIES) == ["least-loaded", "prefix-aware", "round-robin"]
    # the CRD's router.policy enum is generated from the same contract
    assert set(POLICIES) == {p.value for p in RoutingPolicy}
    assert isinstance(create_policy("least-loaded"), LeastLoaded)
    rr = create_policy("round-robin", PolicySettings(short_prompt_threshold=3))
    assert isinstance(rr, RoundRobin) and rr.settings.short_prompt_threshold == 3
    with pytest.raises(ValueError, match=r"'random'.*least-loaded.*round-robin"):
        create_policy("random")


def test_a_policy_module_is_imported_only_when_chosen():
    code = (
        "import sys\n"
        "from tandem.router.config import RouterConfig, apply\n"
        "from tandem.router.policies.registry import create_policy\n"
        "c = apply(RouterConfig(), {'policy': 'round-robin'}, 'test')\n"
        "create_policy(c.policy)\n"
        "print(sorted(m for m in sys.modules if m.startswith('tandem.router.policies.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    loaded = out.stdout.strip()
    assert "round_robin" in loaded and "least_loaded" not in loaded, loaded
