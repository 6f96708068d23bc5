"""The decode pod's sidecar follows the gateway's picker (policies/base.py `pinned_route`): decode on
its own worker, prefill on a named worker only when this router knows it and it may hand KV there;
a header naming anything else is never contacted."""

from __future__ import annotations

import pytest
from tandem.contracts.handoff_parity import ParityState
from tandem.contracts.names import Role
from tandem.contracts.routing import RouteReason
from tandem.router.policies.base import Pinned, RequestInfo, Snapshot, WorkerView
from tandem.router.policies.least_loaded import LeastLoaded
from tandem.router.policies.prefix_aware import PrefixAware
from tandem.router.policies.round_robin import RoundRobin

POLICIES = [LeastLoaded, RoundRobin, PrefixAware]


def W(port: int, role: Role, **kw) -> WorkerView:
    kw.setdefault("ready", True)
    return WorkerView(url=f"http://10.0.0.{port % 10}:{port}", role=role, kv_compat=kw.pop("gen", "g1"), **kw)


P1, P2 = W(8001, Role.PREFILL, running=9), W(8002, Role.PREFILL)
OTHER_GEN = W(8003, Role.PREFILL, gen="g2")
D1, D2 = W(8011, Role.DECODE, running=9), W(8012, Role.DECODE)
SNAP = Snapshot([P1, P2, OTHER_GEN, D1, D2])


def info(*prefill: str, decode: str = D1.url) -> RequestInfo:
    return RequestInfo("r", 1000, pinned=Pinned(decode, tuple(prefill)))


@pytest.mark.parametrize("cls", POLICIES)
def test_the_pinned_workers_win_over_the_policys_own_choice(cls):
    route = cls().route(info("10.0.0.1:8001"), SNAP)  # both are the busier ones: the policy would not pick them
    assert (route.decode, route.prefill, route.reason) == (D1, P1, RouteReason.DISAGGREGATED)


@pytest.mark.parametrize("cls", POLICIES)
def test_no_prefill_named_is_decode_side_prefill(cls):
    route = cls().route(info(), SNAP)
    assert (route.decode, route.prefill, route.reason) == (D1, None, RouteReason.GATEWAY_DECODE)


@pytest.mark.parametrize("named", [
    "203.0.113.9:8000",  # a host this router does not know: never contacted (the internal secret stays here)
    "10.0.0.1:8011",  # wrong: right host, a decode worker's port
    "10.0.0.3:8003",  # another kv_compat: its KV would be garbage here
])
def test_a_named_prefill_worker_that_may_not_hand_kv_here_is_not_used(named):
    route = LeastLoaded().route(info(named), SNAP)
    assert route.decode == D1 and route.prefill is None and route.reason is RouteReason.GATEWAY_PREFILL_UNUSABLE


def test_the_first_usable_of_several_named_and_a_retry_stays_among_them():
    unproven = W(8004, Role.PREFILL, parity=ParityState.MISMATCH)
    snap = Snapshot([*SNAP.workers, unproven])
    request = info("10.0.0.4:8004", "10.0.0.2:8002", "10.0.0.1:8001")
    route = LeastLoaded().route(request, snap)
    assert route.prefill == P2  # the parity probe found 8004 disagreeing
    retry = LeastLoaded().retry_prefill(request, route, snap, frozenset({P2.url}))
    assert retry == P1  # another the picker named, not any prefill worker
    assert LeastLoaded().retry_prefill(request, route, snap, frozenset({P1.url, P2.url})) is None


def test_a_pinned_decode_worker_that_is_not_ready_here_falls_back_to_the_policy():
    snap = Snapshot([P1, P2, W(8011, Role.DECODE, ready=False), D2])
    route = LeastLoaded().route(info("10.0.0.1:8001"), snap)
    assert route.decode == D2 and route.reason is RouteReason.DISAGGREGATED
