"""Rank 0's runner sends every step (and, idle, a heartbeat) to the other ranks before running its
own shard; once the group fails it says why and refuses every later step at once, so requests end
with an error instead of waiting. A forward error while the group still answers stays the step's."""

from __future__ import annotations

import threading
import time

import pytest
from tandem.worker.engine.parallel.executor import Kind, LeaderRunner, Message, follow
from tandem.worker.engine.parallel.group import GroupFailed


class FakeGroup:
    """Records what rank 0 broadcasts; fails from the `fail_at`-th message on (a rank died)."""

    def __init__(self, fail_at: int | None = None, inbox: list[Message] | None = None):
        self.sent: list[Message] = []
        self.fail_at = fail_at
        self.inbox = inbox or []
        self.lock = threading.Lock()

    def broadcast_object(self, obj=None):
        if obj is None:  # a follower receiving
            if not self.inbox:
                raise GroupFailed("rank 0 is silent")
            return self.inbox.pop(0)
        with self.lock:
            if self.fail_at is not None and len(self.sent) >= self.fail_at:
                raise GroupFailed("Connection closed by peer")
            self.sent.append(obj)
        return obj


class Local:
    def __init__(self, error: Exception | None = None):
        self.calls = 0
        self.error = error

    def forward(self, items):
        self.calls += 1
        if self.error is not None:
            raise self.error
        return ("logits", items)


def test_each_step_goes_to_the_group_before_the_local_shard():
    g, local = FakeGroup(), Local()
    r = LeaderRunner(local, g, beat_s=60)
    try:
        assert r.forward([1, 2]) == ("logits", [1, 2])
        assert [(m.kind, m.items) for m in g.sent] == [(Kind.STEP, [1, 2])] and r.problem() is None
    finally:
        r.close()
    assert g.sent[-1].kind is Kind.STOP


def test_a_lost_rank_fails_the_group_for_good():
    g, local = FakeGroup(fail_at=1), Local()
    r = LeaderRunner(local, g, beat_s=60)
    r.forward(["a"])
    with pytest.raises(GroupFailed):
        r.forward(["b"])
    assert "Connection closed by peer" in r.problem()
    with pytest.raises(GroupFailed):  # at once, without touching the group or the model again
        r.forward(["c"])
    assert local.calls == 1
    r.close()


def test_a_step_error_with_a_live_group_stays_the_steps():
    g, local = FakeGroup(), Local(ValueError("bad token"))
    r = LeaderRunner(local, g, beat_s=60)
    with pytest.raises(ValueError, match="bad token"):
        r.forward(["x"])
    assert [m.kind for m in g.sent] == [Kind.STEP, Kind.BEAT] and r.problem() is None
    r.close()


def test_idle_rank_0_beats_and_notices_a_dead_rank_without_a_step():
    g = FakeGroup(fail_at=3)
    r = LeaderRunner(Local(), g, beat_s=0.05)
    deadline = time.monotonic() + 10
    while r.problem() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert r.problem() is not None and [m.kind for m in g.sent] == [Kind.BEAT] * 3
    r.close()


def test_a_follower_runs_steps_until_told_to_stop_and_leaves_a_silent_group():
    local = Local()
    follow(FakeGroup(inbox=[Message(Kind.STEP, [1]), Message(Kind.BEAT), Message(Kind.STEP, [2]),
                            Message(Kind.STOP)]), local)
    assert local.calls == 2
    with pytest.raises(GroupFailed):
        follow(FakeGroup(inbox=[Message(Kind.BEAT)]), Local())
