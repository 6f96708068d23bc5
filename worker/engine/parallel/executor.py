"""Running one step on every rank: rank 0 broadcasts the step's inputs, every rank runs its shard.

Rank 0's engine calls one model runner as always (`LeaderRunner.forward`, the interface of
paged_forward.PagedForward); it broadcasts the step's BatchItems to the other ranks, which wait in
`follow` and run the same forward pass on their shards: the collectives inside it (group.py) meet
rank by rank, and the logits come back on rank 0 only (the others drop theirs). As vLLM's
multiprocess executor and SGLang's TP workers do.

Every wait is bounded: a follower waits at most the group's timeout for the next message, so rank
0 sends a heartbeat when it has had no step to send for `beat_s`; a rank that dies (its sockets
close) or hangs past the timeout makes the next collective raise on the others. Then the group is
broken for good: rank 0's runner reports it (`problem()`, which fails /health) and refuses every
later step at once, so in-flight sequences end with an error rather than waiting; followers exit.
A forward pass that raises on rank 0 for another reason (a sequence's own input) is told apart by
a heartbeat right after it: the group still answers, so the error stays that sequence's
(engine/batch.py retries the rest of the batch).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from tandem.worker.engine.parallel.group import GroupFailed, ParallelGroup

log = logging.getLogger("tandem.worker.engine.parallel")


class Kind(enum.StrEnum):
    STEP = "step"  # run forward(items)
    BEAT = "beat"  # nothing to run: rank 0 is alive, keep waiting
    STOP = "stop"  # leave the group (rank 0 is shutting down)


@dataclass
class Message:
    kind: Kind
    items: list[Any] = field(default_factory=list)


class LeaderRunner:
    """Rank 0's model runner: the step to every rank, then its own shard's forward pass."""

    def __init__(self, local: Any, group: ParallelGroup, beat_s: float = 1.0):
        self.local = local  # the PagedForward over rank 0's shard
        self.group = group
        self.ranks: tuple = ()  # the other ranks' endpoints (KVRank), once they serve
        self.beat_s = beat_s
        self._lock = threading.Lock()  # one message at a time, in the same order on every rank
        self._last_sent = time.monotonic()
        self._failed: str | None = None
        self._stopping = threading.Event()
        self._beater = threading.Thread(target=self._beat_loop, name="tandem-tp-heartbeat", daemon=True)
        self._beater.start()

    def problem(self) -> str | None:
        """Why the group cannot run a step any more, or None."""
        return self._failed

    def forward(self, items: list[Any]) -> Any:
        with self._lock:
            self._send(Message(Kind.STEP, items))
            try:
                return self.local.forward(items)
            except Exception as e:
                self._send(Message(Kind.BEAT))  # the group still answers: the error is this step's own
                raise e

    def _send(self, msg: Message) -> None:
        """Under the lock."""
        if self._failed is not None:
            raise GroupFailed(self._failed)
        try:
            self.group.broadcast_object(msg)
        except GroupFailed as e:
            self._fail(str(e))
            raise
        self._last_sent = time.monotonic()

    def _fail(self, why: str) -> None:
        if self._failed is None:
            self._failed = f"a rank of the tensor-parallel group failed: {why}"
            log.error("%s; the worker stops serving", self._failed)

    def _beat_loop(self) -> None:
        while not self._stopping.wait(self.beat_s / 4):
            if self._failed is not None:
                return
            if time.monotonic() - self._last_sent < self.beat_s or not self._lock.acquire(blocking=False):
                continue  # a step is running (its collectives are the heartbeat) or one went out lately
            try:
                self._send(Message(Kind.BEAT))
            except GroupFailed:
                return
            finally:
                self._lock.release()

    def close(self) -> None:
        """Tell the other ranks to leave (they exit) and stop the heartbeat."""
        self._stopping.set()
        with self._lock:
            if self._failed is None:
                try:
                    self.group.broadcast_object(Message(Kind.STOP))
                except GroupFailed:
                    pass
                self._failed = "the tensor-parallel group was stopped"
        self._beater.join(timeout=5)


def follow(group: ParallelGroup, runner: Any) -> None:
    """A follower rank's life after start-up: run every step rank 0 sends until it says stop.
    Raises GroupFailed when rank 0 (or another rank) is gone or silent past the timeout."""
    steps = 0
    while True:
        msg = group.broadcast_object()
        if msg.kind is Kind.STOP:
            log.info("rank 0 stopped the group after %d steps", steps)
            return
        if msg.kind is Kind.STEP:
            try:
                runner.forward(msg.items)
            except GroupFailed:
                raise
            except Exception:  # noqa: BLE001 - rank 0 raised on the same input (it checks the group)
                log.exception("a step failed on this rank")
            steps += 1
