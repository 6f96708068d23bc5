"""Leader election's decisions on a Lease (tandem.operator.election). Pure: the clock is passed in.
What they do against a real API server made slow or unreachable: test_leader_stops_by_its_renew_deadline.py."""

from __future__ import annotations

import datetime

import pytest
from tandem.operator.election import (
    ElectionConfig,
    Record,
    Renewal,
    Verdict,
    attempt_until,
    call_timeout,
    claim,
    judge,
    leading_until,
    release,
    renewal,
)

WHEN = datetime.datetime(2026, 1, 1, 12, 0, 0, 123456, tzinfo=datetime.UTC)


def test_a_missing_lease_is_created_and_a_free_or_released_one_taken():
    assert judge(None, "a", 0.0, 0.0) is Verdict.CREATE
    assert judge(Record(None, 15), "a", 0.0, 0.0) is Verdict.TAKE, "released: no need to wait"


def test_a_held_lease_is_taken_only_after_it_went_unrenewed_for_its_duration_on_our_clock():
    held = Record("b", 15, renew_time="2020-01-01T00:00:00.000000Z")  # b's clock is far behind: ignored
    assert judge(held, "a", changed_at=100.0, now=100.0) is Verdict.WAIT
    assert judge(held, "a", changed_at=100.0, now=114.9) is Verdict.WAIT
    assert judge(held, "a", changed_at=100.0, now=115.0) is Verdict.TAKE
    assert judge(held, "b", changed_at=0.0, now=1e9) is Verdict.RENEW, "the holder renews"


def test_what_each_move_writes():
    taken = claim(Record("b", 15, "t0", "t1", transitions=2, resource_version="7"), "a", 15, Verdict.TAKE, WHEN)
    assert taken == {"holderIdentity": "a", "leaseDurationSeconds": 15, "renewTime": "2026-01-01T12:00:00.123456Z",
                     "acquireTime": "2026-01-01T12:00:00.123456Z", "leaseTransitions": 3}
    renewed = claim(Record("a", 15, "t0", "t1", transitions=3), "a", 15, Verdict.RENEW, WHEN)
    assert renewed["acquireTime"] == "t0" and renewed["leaseTransitions"] == 3
    assert renewed["renewTime"] == "2026-01-01T12:00:00.123456Z"
    assert claim(None, "a", 15, Verdict.CREATE, WHEN)["leaseTransitions"] == 0
    assert claim(Record(None, 1, "t0", transitions=3), "a", 15, Verdict.TAKE, WHEN)["leaseTransitions"] == 3
    freed = release(Record("a", 15, "t0", "t1", transitions=3), WHEN)
    assert freed["holderIdentity"] is None and freed["leaseTransitions"] == 3


def test_a_record_reads_a_lease_and_what_any_write_changes():
    lease = {"metadata": {"resourceVersion": "9"}, "spec": {
        "holderIdentity": "a", "leaseDurationSeconds": 15, "renewTime": "r", "acquireTime": "q", "leaseTransitions": 2}}
    r = Record.of(lease)
    assert (r.holder, r.duration_s, r.resource_version, r.seen) == ("a", 15, "9", ("a", "r", 2))
    assert Record.of({"metadata": {}, "spec": {"holderIdentity": ""}}).holder is None


def test_the_timing_must_leave_a_lost_leader_time_to_stop():
    ElectionConfig("ns", duration_s=15, renew_deadline_s=10, retry_s=2)
    with pytest.raises(ValueError, match="retry < renew deadline < lease duration"):
        ElectionConfig("ns", duration_s=10, renew_deadline_s=10, retry_s=2)


def test_a_failed_call_of_any_kind_is_a_failed_renewal_and_only_another_holder_ends_it():
    assert renewal(True, "a", "a") is Renewal.RENEWED
    assert renewal(None, "a", "a") is Renewal.FAILED, "a call raised (MaxRetryError, a 5xx, a timeout): not an exit"
    assert renewal(None, "b", "a") is Renewal.FAILED, "what raised says nothing about who holds the Lease"
    assert renewal(False, "a", "a") is Renewal.FAILED, "a conflict: another write came in between"
    assert renewal(False, None, "a") is Renewal.FAILED
    assert renewal(False, "b", "a") is Renewal.TAKEN


def test_the_leader_stops_leading_before_a_standby_may_take_the_lease():
    """The deadline counts from when the last successful renewal was sent; a standby times the Lease's
    duration from when it saw that write, which is later: with the defaults and a slow API server
    alike, the two never lead at once."""
    config = ElectionConfig("ns")
    for sent, seen in ((100.0, 100.0), (100.0, 100.5), (100.0, 109.9)):
        stop = leading_until(sent, config)
        assert stop == sent + 10.0
        assert judge(Record("a", config.duration_s), "b", changed_at=seen, now=stop) is Verdict.WAIT
        assert stop < seen + config.duration_s


def test_every_call_of_a_renewal_is_bounded_by_the_time_its_attempt_has_left():
    config = ElectionConfig("ns", duration_s=15, renew_deadline_s=10, retry_s=2)
    assert attempt_until(started=102.0, renewed_at=100.0, config=config) == 104.0, "one retry period"
    assert attempt_until(started=109.0, renewed_at=100.0, config=config) == 110.0, "never past the deadline"
    assert call_timeout(now=102.0, until=104.0) == 1.0, "its connect and its read each get half"
    assert call_timeout(now=109.95, until=110.0) is None, "no call is made that could only time out"
    assert call_timeout(now=111.0, until=110.0) is None
