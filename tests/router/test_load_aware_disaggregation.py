"""Load-aware disaggregation (issue 13 item 5), the rule in PairedPolicy: when every ready prefill
worker of the paired kv_compat has `prefill_saturated_tokens` prompt tokens queued, a decode
worker with headroom prefills the prompt itself (route prefill_saturated); without headroom the
prompt waits for prefill. Every policy keeps the rule; 0 turns it off."""

from __future__ import annotations

import pytest
from tandem.contracts.names import Role
from tandem.contracts.routing import RouteReason
from tandem.router.policies.base import (
    DECODE_HEADROOM_KV,
    PolicySettings,
    RequestInfo,
    Snapshot,
    WorkerView,
)
from tandem.router.policies.registry import POLICIES, create_policy

PROMPT = RequestInfo("r", prompt_tokens=600)
SETTINGS = PolicySettings(prefill_saturated_tokens=2000, decode_headroom_sequences=8)


def W(url: str, role: Role, **kw) -> WorkerView:
    return WorkerView(url=url, role=role, kv_compat=kw.pop("gen", "g1"), ready=kw.pop("ready", True), **kw)


def busy_prefill(queued: int = 2500) -> list[WorkerView]:
    return [W("p1", Role.PREFILL, outstanding_prompt_tokens=queued),
            W("p2", Role.PREFILL, outstanding_prompt_tokens=queued + 100)]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_saturated_prefill_pool_sends_the_prompt_to_a_decode_worker_with_headroom(name):
    ws = [*busy_prefill(), W("d1", Role.DECODE, running=3), W("d2", Role.DECODE, running=7)]
    route = create_policy(name, SETTINGS).route(PROMPT, Snapshot(ws))
    assert route.reason is RouteReason.PREFILL_SATURATED and route.prefill is None
    assert route.decode.url in {"d1", "d2"}


def test_the_least_loaded_decode_worker_with_headroom_helps():
    ws = [*busy_prefill(), W("d1", Role.DECODE, running=5), W("d2", Role.DECODE, running=2),
          W("c1", Role.COLOCATED, running=1, kv_usage=0.95)]  # colocated would help, but its KV is full
    route = create_policy("least-loaded", SETTINGS).route(PROMPT, Snapshot(ws))
    assert (route.decode.url, route.reason) == ("d2", RouteReason.PREFILL_SATURATED)


def test_one_prefill_worker_below_the_limit_means_not_saturated():
    ws = [W("p1", Role.PREFILL, outstanding_prompt_tokens=5000),
          W("p2", Role.PREFILL, outstanding_prompt_tokens=1999), W("d1", Role.DECODE)]
    route = create_policy("least-loaded", SETTINGS).route(PROMPT, Snapshot(ws))
    assert (route.prefill.url, route.reason) == ("p2", RouteReason.DISAGGREGATED)


@pytest.mark.parametrize("decode", [
    W("d1", Role.DECODE, running=8),  # as many sequences as the headroom allows
    W("d1", Role.DECODE, running=1, waiting=7),
    W("d1", Role.DECODE, router_inflight=8),  # sent by this router, not yet in its numbers
    W("d1", Role.DECODE, kv_usage=DECODE_HEADROOM_KV),
    W("d1", Role.DECODE, outstanding_prompt_tokens=2500),  # no sooner there than on prefill
    W("d1", Role.DECODE, outstanding_prompt_tokens=2000, router_prompt_tokens=600),
], ids=["running", "waiting", "router-inflight", "kv-full", "its-own-queue", "its-queue-with-router-share"])
def test_without_headroom_the_prompt_waits_for_prefill(decode):
    route = create_policy("least-loaded", SETTINGS).route(PROMPT, Snapshot([*busy_prefill(), decode]))
    assert (route.prefill.url, route.decode.url, route.reason) == ("p1", "d1", RouteReason.DISAGGREGATED)


def test_prompt_tokens_this_router_sent_count_before_the_next_poll():
    ws = [W("p1", Role.PREFILL, outstanding_prompt_tokens=1500, router_prompt_tokens=600), W("d1", Role.DECODE)]
    assert create_policy("least-loaded", SETTINGS).route(PROMPT, Snapshot(ws)).reason is RouteReason.PREFILL_SATURATED
    ws[0].router_prompt_tokens = 0
    assert create_policy("least-loaded", SETTINGS).route(PROMPT, Snapshot(ws)).reason is RouteReason.DISAGGREGATED


def test_only_the_paired_kv_compats_prefill_pool_counts():
    ws = [W("p-old", Role.PREFILL, gen="old", first_seen=1),
          W("p-new", Role.PREFILL, gen="new", first_seen=5, outstanding_prompt_tokens=3000),
          W("d-new", Role.DECODE, gen="new", first_seen=6), W("d-old", Role.DECODE, gen="old", first_seen=1)]
    route = create_policy("least-loaded", SETTINGS).route(PROMPT, Snapshot(ws))
    assert route.reason is RouteReason.PREFILL_SATURATED  # the idle old prefill worker is not this pair's


def test_zero_turns_the_rule_off():
    off = PolicySettings(prefill_saturated_tokens=0)
    ws = [*busy_prefill(10**6), W("d1", Role.DECODE)]
    assert create_policy("least-loaded", off).route(PROMPT, Snapshot(ws)).reason is RouteReason.DISAGGREGATED


def test_the_default_rule_is_on():
    ws = [*busy_prefill(PolicySettings().prefill_saturated_tokens), W("d1", Role.DECODE)]
    assert create_policy("least-loaded").route(PROMPT, Snapshot(ws)).reason is RouteReason.PREFILL_SATURATED
