"""Rank 0's runner sends every step (and, idle, a heartbeat) to the other ranks before running its
own shard; once the group fails it says why and refuses every later step at once, so requests end
with an error instead of waiting. A sequence's bad input is refused before the group hears of the
step (it stays that sequence's); an error once the step has started fails the group at once."""

from __future__ import annotations

import threading
import time

import pytest
from tandem.worker.engine.model_runner import BatchItem
from tandem.worker.engine.parallel.executor import (
    Kind,
    LeaderRunner,
    Message,
    StepInputError,
    StepLimits,
    follow,
)
from tandem.worker.engine.parallel.group import GroupFailed

LIMITS = StepLimits(vocab=100, positions=64, blocks=8, block_size=4)


def item(tok: int = 1, start: int = 0, table: list[int] | None = None) -> BatchItem:
    return BatchItem([tok], start, [0] if table is None else table, True)


class FakeGroup:
    """Records what rank 0 broadcasts; fails from the `fail_at`-th message on (a rank died)."""

    def __init__(self, fail_at: int | None = None, inbox: list[Message] | None = None):
        self.sent: list[Message] = []
        self.fail_at = fail_at
        self.inbox = inbox or []
        self.lock = threading.Lock()

        self.closed = False

    def broadcast(self, value=None):
        """What crosses is JSON (as between real ranks); `sent` keeps the messages it carried."""
        if value is None:  # a follower receiving
            if not self.inbox:
                raise GroupFailed("rank 0 is silent")
            return self.inbox.pop(0).to_json()
        with self.lock:
            if self.fail_at is not None and len(self.sent) >= self.fail_at:
                raise GroupFailed("Connection closed by peer")
            self.sent.append(Message.from_json(value))
        return value

    def close(self):
        self.closed = True


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
    r = LeaderRunner(local, g, LIMITS, beat_s=60)
    try:
        assert r.forward([item(1), item(2)]) == ("logits", [item(1), item(2)])
        assert [(m.kind, m.items) for m in g.sent] == [(Kind.STEP, [item(1), item(2)])] and r.problem() is None
    finally:
        r.close()
    assert g.sent[-1].kind is Kind.STOP


def test_a_lost_rank_fails_the_group_for_good():
    g, local = FakeGroup(fail_at=1), Local()
    r = LeaderRunner(local, g, LIMITS, beat_s=60)
    r.forward([item(1)])
    with pytest.raises(GroupFailed):
        r.forward([item(2)])
    assert "Connection closed by peer" in r.problem()
    with pytest.raises(GroupFailed):  # at once, without touching the group or the model again
        r.forward([item(3)])
    assert local.calls == 1
    r.close()


@pytest.mark.parametrize(("bad", "why"), [
    (item(tok=100), "token ids"), (item(tok=-1), "token ids"), (BatchItem([], 0, [0], True), "token ids"),
    (item(start=64, table=list(range(8)) * 3), "outside the context"),
    (item(start=4), "does not cover position 4"), (item(table=[8]), "blocks of the pool"),
])
def test_a_sequences_bad_input_is_refused_before_the_group_hears_of_it(bad, why):
    g, local = FakeGroup(), Local()
    r = LeaderRunner(local, g, LIMITS, beat_s=60)
    with pytest.raises(StepInputError, match=why):
        r.forward([item(1), bad])
    assert g.sent == [] and local.calls == 0 and r.problem() is None  # the group goes on
    assert r.forward([item(1)]) == ("logits", [item(1)])
    r.close()


def test_an_error_once_the_step_started_fails_the_group_at_once():
    g, local = FakeGroup(), Local(ValueError("device fault"))
    r = LeaderRunner(local, g, LIMITS, beat_s=60)
    with pytest.raises(GroupFailed, match="device fault"):
        r.forward([item(1)])
    assert [m.kind for m in g.sent] == [Kind.STEP] and g.closed and "device fault" in r.problem()
    with pytest.raises(GroupFailed):
        r.forward([item(1)])
    assert local.calls == 1
    r.close()


def test_idle_rank_0_beats_and_notices_a_dead_rank_without_a_step():
    g = FakeGroup(fail_at=3)
    r = LeaderRunner(Local(), g, LIMITS, beat_s=0.05)
    deadline = time.monotonic() + 10
    while r.problem() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert r.problem() is not None and [m.kind for m in g.sent] == [Kind.BEAT] * 3
    r.close()


def test_a_follower_runs_steps_until_told_to_stop_and_leaves_a_silent_group():
    local = Local()
    follow(FakeGroup(inbox=[Message(Kind.STEP, [item(1)]), Message(Kind.BEAT), Message(Kind.STEP, [item(2)]),
                            Message(Kind.STOP)]), local)
    assert local.calls == 2
    with pytest.raises(GroupFailed):
        follow(FakeGroup(inbox=[Message(Kind.BEAT)]), Local())


def test_a_follower_whose_own_step_raises_leaves_instead_of_going_on_out_of_step():
    local = Local(RuntimeError("out of memory"))
    with pytest.raises(GroupFailed, match="out of memory"):
        follow(FakeGroup(inbox=[Message(Kind.STEP, [item(1)]), Message(Kind.STEP, [item(2)])]), local)
    assert local.calls == 1
