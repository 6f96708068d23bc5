"""The handoff parity check's decisions as plain function calls: how two scorings compare, which
pairing is probed next, what a result means for each worker, and how the policy routes around a
pairing that is not proven."""

from __future__ import annotations

import math

import pytest
from tandem.contracts.handoff_parity import (
    RECHECK_S,
    ParityReport,
    ParityState,
    ProbeOutcome,
    ProbeResult,
)
from tandem.contracts.names import Role
from tandem.contracts.routing import RouteReason
from tandem.router.parity.decisions import ParityTable, Scored, compare, probe_tokens, tolerance_for
from tandem.router.policies.base import RequestInfo, Snapshot, WorkerView
from tandem.router.policies.least_loaded import LeastLoaded

CONT = [5, 6, 7]


def scored(*lps: float, tokens: list[int] = CONT) -> list[Scored]:
    return [Scored(t, lp) for t, lp in zip(tokens, lps, strict=True)]


def view(url: str, role: Role, gen: str = "g1", seen: float = 0.0, parity: ParityState | None = None) -> WorkerView:
    return WorkerView(url, role, kv_compat=gen, ready=True, first_seen=seen, dtype="float32", parity=parity)


def result(pair, outcome: ProbeOutcome, diff: float | None = None) -> ProbeResult:
    return ProbeResult(pair.prefill.url, pair.decode.url, "g1", outcome, max_abs_diff=diff)


def test_equal_scorings_match_with_zero_difference():
    outcome, diff, message = compare(scored(-1.5, -2.0, -0.25), scored(-1.5, -2.0, -0.25), 0.0, CONT)
    assert (outcome, diff) == (ProbeOutcome.MATCH, 0.0)
    assert "max |logprob difference| 0 over 3 tokens" in message


def test_a_difference_beyond_the_tolerance_is_a_mismatch_naming_it():
    outcome, diff, message = compare(scored(-1.5, -2.0, -0.25), scored(-1.5, -3.25, -0.25), 1e-4, CONT)
    assert outcome is ProbeOutcome.MISMATCH and diff == pytest.approx(1.25)
    assert "1.25" in message and "continuation token 1" in message and "tolerance 0.0001" in message


def test_a_difference_within_the_tolerance_matches():
    outcome, diff, _ = compare(scored(-1.5, -2.0, -0.25), scored(-1.5, -2.05, -0.25), 0.1, CONT)
    assert outcome is ProbeOutcome.MATCH and diff == pytest.approx(0.05)


def test_nan_never_matches():
    outcome, diff, _ = compare(scored(-1.5, math.nan, -0.25), scored(-1.5, -2.0, -0.25), 10.0, CONT)
    assert outcome is ProbeOutcome.MISMATCH and diff == math.inf


def test_tokens_other_than_the_forced_ones_are_an_error_not_a_verdict():
    outcome, diff, message = compare(scored(-1.0, -1.0, -1.0, tokens=[5, 9, 7]), scored(-1.0, -1.0, -1.0),
                                     1.0, CONT)
    assert outcome is ProbeOutcome.ERROR and diff is None and "teacher forcing" in message


def test_tolerance_by_dtype_unless_configured():
    assert tolerance_for("float32") == 1e-4 and tolerance_for("bfloat16") == 1.0
    assert tolerance_for("float16") == 0.25 and tolerance_for("bfloat16", 0.0) == 0.0 and tolerance_for("") == 1.0


def test_probe_tokens_are_fixed_by_their_seed_and_inside_any_vocabulary():
    prompt, cont = probe_tokens(7)
    assert (prompt, cont) == probe_tokens(7) and (prompt, cont) != probe_tokens(8)
    assert len(prompt) == 96 and len(cont) == 8 and all(3 <= t < 256 for t in prompt + cont)


def test_a_new_pairing_is_probed_and_verified_together():
    p, d = view("http://p", Role.PREFILL), view("http://d", Role.DECODE, seen=1)
    table = ParityTable()
    table.update([p, d])
    assert table.state(p.url) is ParityState.UNCHECKED
    pair = table.next_pair([p, d], 0.0)
    assert (pair.prefill.url, pair.decode.url, pair.subjects) == (p.url, d.url, {p.url, d.url})
    table.begin(pair)
    assert table.next_pair([p, d], 0.0) is None and not table.settled([p, d], 0.0)
    table.finish(pair, result(pair, ProbeOutcome.MATCH, 0.0), 1.0)
    assert table.state(p.url) is table.state(d.url) is ParityState.VERIFIED
    assert table.next_pair([p, d], 100.0) is None and table.settled([p, d], 1.0)


def test_a_worker_without_a_partner_of_its_kv_compat_waits():
    p, d = view("http://p", Role.PREFILL, gen="g1"), view("http://d", Role.DECODE, gen="g2")
    table = ParityTable()
    table.update([p, d])
    assert table.next_pair([p, d], 0.0) is None and table.settled([p, d], 0.0)


def test_a_mismatch_with_a_verified_partner_marks_only_the_newcomer():
    p, good, bad = view("http://p", Role.PREFILL), view("http://d1", Role.DECODE), view("http://d2", Role.DECODE)
    table = ParityTable()
    table.update([p, good])
    first = table.next_pair([p, good], 0.0)
    table.begin(first)
    table.finish(first, result(first, ProbeOutcome.MATCH, 0.0), 0.0)
    table.update([p, good, bad])
    pair = table.next_pair([p, good, bad], 0.0)
    assert (pair.prefill.url, pair.decode.url, pair.subjects) == (p.url, bad.url, {bad.url})
    table.begin(pair)
    table.finish(pair, result(pair, ProbeOutcome.MISMATCH, 2.5), 1.0)
    assert table.state(bad.url) is ParityState.MISMATCH
    assert table.state(p.url) is table.state(good.url) is ParityState.VERIFIED
    report = ParityReport.from_dict(table.report().to_dict())
    bad_entry = next(w for w in report.workers if w.url == bad.url)
    assert bad_entry.state is ParityState.MISMATCH and bad_entry.last.max_abs_diff == 2.5
    assert report.probes_total == {"match": 1, "mismatch": 1}


def test_two_new_workers_that_disagree_are_both_suspect_until_one_agrees_with_a_third():
    p, bad, good = view("http://p", Role.PREFILL), view("http://d1", Role.DECODE), view("http://d2", Role.DECODE,
                                                                                       seen=5)
    table = ParityTable()
    table.update([p, bad])
    pair = table.next_pair([p, bad], 0.0)
    table.begin(pair)
    table.finish(pair, result(pair, ProbeOutcome.MISMATCH, 3.0), 0.0)
    assert table.state(p.url) is table.state(bad.url) is ParityState.MISMATCH
    table.update([p, bad, good])
    pair = table.next_pair([p, bad, good], 0.0)
    assert pair.decode.url == good.url and pair.subjects == {p.url, good.url}
    table.begin(pair)
    table.finish(pair, result(pair, ProbeOutcome.MATCH, 0.0), 1.0)
    assert table.state(p.url) is table.state(good.url) is ParityState.VERIFIED
    assert table.state(bad.url) is ParityState.MISMATCH


def test_a_probe_that_cannot_finish_is_retried_with_backoff():
    p, d = view("http://p", Role.PREFILL), view("http://d", Role.DECODE)
    table = ParityTable(retry_s=2.0, max_retry_s=5.0)
    table.update([p, d])
    for attempt, wait in enumerate((2.0, 4.0, 5.0)):
        now = attempt * 100.0
        pair = table.next_pair([p, d], now)
        table.begin(pair)
        table.finish(pair, result(pair, ProbeOutcome.ERROR), now)
        assert table.state(d.url) is ParityState.FAILED
        assert table.next_pair([p, d], now + wait - 0.1) is None
        assert table.next_due(now) == pytest.approx(now + wait)
    assert table.next_pair([p, d], 200.0 + 5.0) is not None


def probed(table: ParityTable, views: list, outcome: ProbeOutcome, now: float):
    """The next pair probed with `outcome` at `now`."""
    pair = table.next_pair(views, now)
    assert pair is not None
    table.begin(pair)
    table.finish(pair, result(pair, outcome, 3.0 if outcome is ProbeOutcome.MISMATCH else 0.0), now)
    return pair


def test_a_good_worker_shut_out_by_a_broken_partner_is_probed_again_against_a_verified_one():
    """Issue 28 item 7: at start-up a broken decode pod drags its prefill partner into MISMATCH; once
    another pairing is VERIFIED, the prefill worker is probed again with it, without any recheck."""
    bad, p1 = view("http://bad", Role.DECODE, seen=0), view("http://p1", Role.PREFILL, seen=1)
    good, p2 = view("http://good", Role.DECODE, seen=2), view("http://p2", Role.PREFILL, seen=3)
    views = [bad, p1, good, p2]
    table = ParityTable(recheck_s=0.0)
    table.update(views)
    first = probed(table, views, ProbeOutcome.MISMATCH, 0.0)
    assert (first.prefill.url, first.decode.url) == (p1.url, bad.url)
    assert table.state(p1.url) is table.state(bad.url) is ParityState.MISMATCH
    assert not table.settled(views, 0.0), "a suspect is not settled while a verified partner may clear it"
    second = probed(table, views, ProbeOutcome.MATCH, 1.0)
    assert (second.prefill.url, second.decode.url) == (p2.url, good.url)
    for now in (2.0, 3.0):  # each suspect once, against a VERIFIED partner, the broken pod failing again
        again = table.next_pair(views, now)
        (subject,) = again.subjects
        partner = again.decode if subject == again.prefill.url else again.prefill
        assert subject in (p1.url, bad.url) and table.state(partner.url) is ParityState.VERIFIED
        probed(table, views, ProbeOutcome.MISMATCH if subject == bad.url else ProbeOutcome.MATCH, now)
    assert table.state(p1.url) is ParityState.VERIFIED, "the good prefill worker takes handoffs again"
    assert table.state(bad.url) is ParityState.MISMATCH, "the broken one, isolated by a verified partner"
    assert table.next_pair(views, 1e9) is None and table.next_due(3.0) is None and table.settled(views, 3.0)


def test_a_suspect_without_a_verified_partner_waits_without_a_busy_loop():
    p, bad = view("http://p", Role.PREFILL), view("http://d", Role.DECODE)
    table = ParityTable(recheck_s=0.0)
    table.update([p, bad])
    probed(table, [p, bad], ProbeOutcome.MISMATCH, 0.0)
    assert table.next_pair([p, bad], 50.0) is None, "two suspects cannot clear each other"
    assert table.next_due(50.0) is None and table.settled([p, bad], 50.0)


def test_a_mismatch_is_rechecked_only_against_a_verified_partner_and_by_default():
    assert ParityTable().recheck_s == RECHECK_S and 60 <= RECHECK_S <= 900
    p, good, bad = view("http://p", Role.PREFILL), view("http://d1", Role.DECODE), view("http://d2", Role.DECODE, seen=1)
    table = ParityTable(recheck_s=100.0)
    table.update([p, good])
    probed(table, [p, good], ProbeOutcome.MATCH, 0.0)
    table.update([p, good, bad])
    probed(table, [p, good, bad], ProbeOutcome.MISMATCH, 10.0)
    assert table.next_pair([p, good, bad], 99.0) is None and table.next_due(10.0) == pytest.approx(100.0)
    recheck = table.next_pair([p, good, bad], 110.0)
    assert recheck.subjects == {bad.url} and recheck.prefill.url == p.url
    table.workers[p.url].state = ParityState.MISMATCH  # the only prefill worker found bad as well
    assert table.next_pair([p, bad], 200.0) is None, "two MISMATCH workers are never paired to clear each other"


def test_the_router_and_the_operators_rendered_config_recheck_by_default():
    from tandem.operator import render
    from tandem.router.config import RouterConfig

    assert RouterConfig().parity_recheck_s == RECHECK_S
    assert render.router_config("svc", "ns", {"model": {"maxModelLen": 4096}})["parity_recheck_s"] == RECHECK_S


def test_a_gone_worker_is_forgotten_and_a_new_worker_on_its_address_starts_over():
    p, d = view("http://p", Role.PREFILL), view("http://d", Role.DECODE)
    table = ParityTable()
    table.update([p, d])
    pair = table.next_pair([p, d], 0.0)
    table.begin(pair)
    table.finish(pair, result(pair, ProbeOutcome.MATCH, 0.0), 0.0)
    table.update([p, view("http://d", Role.DECODE, gen="g2")])
    assert table.state(d.url) is ParityState.UNCHECKED and table.state(p.url) is ParityState.VERIFIED
    d.engine_id = "d-1"
    table.update([p, d])
    pair = table.next_pair([p, d], 0.0)
    table.begin(pair)
    table.finish(pair, result(pair, ProbeOutcome.MATCH, 0.0), 0.0)
    assert table.state(d.url) is ParityState.VERIFIED
    d.engine_id = "d-2"  # the same pod's worker restarted: what was proven of it no longer holds
    table.update([p, d])
    assert table.state(d.url) is ParityState.UNCHECKED
    table.update([p])
    assert set(table.workers) == {p.url}


def test_the_policy_hands_off_only_across_a_proven_pairing():
    policy = LeastLoaded()
    request = RequestInfo("r", prompt_tokens=500)
    for state, reason in ((None, RouteReason.DISAGGREGATED), (ParityState.VERIFIED, RouteReason.DISAGGREGATED),
                         (ParityState.UNCHECKED, RouteReason.PARITY_UNVERIFIED),
                         (ParityState.FAILED, RouteReason.PARITY_UNVERIFIED),
                         (ParityState.MISMATCH, RouteReason.PARITY_MISMATCH)):
        route = policy.route(request, Snapshot([view("http://p", Role.PREFILL, parity=state),
                                              view("http://d", Role.DECODE, parity=state)]))
        assert route.reason is reason, state
        assert (route.prefill is not None) == (reason is RouteReason.DISAGGREGATED)
        assert route.decode.url == "http://d"  # decode-side prefill still serves


def test_the_policy_keeps_the_proven_decode_worker_and_an_older_proven_kv_compat():
    policy = LeastLoaded()
    request = RequestInfo("r", prompt_tokens=500)
    workers = [view("http://p", Role.PREFILL, parity=ParityState.VERIFIED),
               view("http://bad", Role.DECODE, parity=ParityState.MISMATCH),
               view("http://good", Role.DECODE, parity=ParityState.VERIFIED)]
    workers[1].running = 0
    workers[2].running = 10  # busier, still the only one proven
    route = policy.route(request, Snapshot(workers))
    assert (route.reason, route.prefill.url, route.decode.url) == (RouteReason.DISAGGREGATED, "http://p", "http://good")
    rollout = [view("http://p1", Role.PREFILL, "old", 0, ParityState.VERIFIED),
               view("http://d1", Role.DECODE, "old", 0, ParityState.VERIFIED),
               view("http://p2", Role.PREFILL, "new", 9, ParityState.UNCHECKED),
               view("http://d2", Role.DECODE, "new", 9, ParityState.UNCHECKED)]
    route = policy.route(request, Snapshot(rollout))
    assert (route.reason, route.prefill.url, route.decode.url) == (RouteReason.DISAGGREGATED, "http://p1", "http://d1")
