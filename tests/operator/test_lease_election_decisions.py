"""Leader election's decisions on a Lease (tandem.operator.lease). Pure: the clock is passed in."""

from __future__ import annotations

import datetime

import pytest
from tandem.operator.lease import ElectionConfig, Record, Verdict, claim, judge, release

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
