"""Running one step on every rank: rank 0 broadcasts the step's inputs, every rank runs its shard.

Rank 0's engine calls one model runner as always (`LeaderRunner.forward`, the interface of
model_runner.ModelRunner); it broadcasts the step's BatchItems to the other ranks, which wait in
`follow` and run the same forward pass on their shards: the collectives inside it (group.py) meet
rank by rank, and the logits come back on rank 0 only (the others drop theirs). As vLLM's
multiprocess executor and SGLang's TP workers do.

Every wait is bounded: a follower waits at most the group's timeout for the next message, so rank
0 sends a heartbeat when it has had no step to send for `beat_s`; a rank that dies (its sockets
close) or hangs past the timeout makes the next collective raise on the others. Then the group is
broken for good: rank 0's runner reports it (`problem()`, which fails /health) and refuses every
later step at once, so in-flight sequences end with an error rather than waiting; followers exit.

A sequence's own bad input must fail that sequence alone, and it can only do so before the step's
first collective: rank 0 checks every input that depends on a sequence (token ids, positions,
block ids: `StepLimits.problem`) before it sends the step, and raises StepInputError without
touching the group (engine/batch.py then finds the sequence). An error once the step has started
leaves the ranks at different collectives: rank 0 then fails the group at once and closes it, so
the others fail now rather than at the timeout, and a follower whose own step raises leaves too.
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


class StepInputError(ValueError):
    """A step's input that no rank could run (out of the vocabulary, the context or the pool)."""


@dataclass(frozen=True)
class StepLimits:
    """What every sequence-dependent input of a step must stay within, on every rank."""

    vocab: int
    positions: int  # the engine's context length
    blocks: int  # the pool's blocks (block ids are the group's)
    block_size: int

    def problem(self, items: list[Any]) -> str | None:
        """Why one of `items` (model_runner.BatchItem) cannot run, or None."""
        for n, it in enumerate(items):
            ids, table = it.token_ids, it.block_table
            if not ids or min(ids) < 0 or max(ids) >= self.vocab:
                return f"item {n}: token ids must be 1 or more, each in [0, {self.vocab})"
            last = it.start + len(ids) - 1
            if it.start < 0 or last >= self.positions:
                return f"item {n}: positions {it.start}..{last} are outside the context of {self.positions}"
            if last // self.block_size >= len(table) or (table and (min(table) < 0 or max(table) >= self.blocks)):
                return f"item {n}: its block table does not cover position {last} with blocks of the pool's " \
                       f"{self.blocks}"
        return None


class Kind(enum.StrEnum):
    STEP = "step"  # run forward(items)
    BEAT = "beat"  # nothing to run: rank 0 is alive, keep waiting
    STOP = "stop"  # leave the group (rank 0 is shutting down)


@dataclass
class Message:
    kind: Kind
    items: list[Any] = field(default_factory=list)  # model_runner.BatchItem

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind.value,
                "items": [[i.token_ids, i.start, i.block_table, i.sample] for i in self.items]}

    @classmethod
    def from_json(cls, value: Any) -> Message:
        """The message rank 0 sent (its seal already checked); GroupFailed for any other shape."""
        from tandem.worker.engine.model_runner import BatchItem

        try:
            items = [BatchItem(list(ids), int(start), list(table), bool(sample))
                     for ids, start, table, sample in value["items"]]
            return cls(Kind(value["kind"]), items)
        except (KeyError, TypeError, ValueError) as e:
            raise GroupFailed(f"a step from rank 0 is not a step message: {e}") from e


class LeaderRunner:
    """Rank 0's model runner: the step to every rank, then its own shard's forward pass."""

    def __init__(self, local: Any, group: ParallelGroup, limits: StepLimits, beat_s: float = 1.0):
        self.local = local  # the TransformersForward over rank 0's share
        self.group = group
        self.limits = limits
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
        if (why := self.limits.problem(items)) is not None:
            raise StepInputError(why)  # before the group hears of the step: it stays this step's
        with self._lock:
            self._send(Message(Kind.STEP, items))
            try:
                return self.local.forward(items)
            except Exception as e:  # the ranks may now wait at different collectives: fail now
                self._fail(f"rank 0's step raised after the group started it: {e!r}")
                self.group.close()  # the others' collectives fail at once instead of at the timeout
                raise GroupFailed(self._failed) from e

    def _send(self, msg: Message) -> None:
        """Under the lock."""
        if self._failed is not None:
            raise GroupFailed(self._failed)
        try:
            self.group.broadcast(msg.to_json())
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
                    self.group.broadcast(Message(Kind.STOP).to_json())
                except GroupFailed:
                    pass
                self._failed = "the tensor-parallel group was stopped"
        self._beater.join(timeout=5)


def follow(group: ParallelGroup, runner: Any) -> None:
    """A follower rank's life after start-up: run every step rank 0 sends until it says stop.
    Raises GroupFailed when rank 0 (or another rank) is gone or silent past the timeout."""
    steps = 0
    while True:
        msg = Message.from_json(group.broadcast())
        if msg.kind is Kind.STOP:
            log.info("rank 0 stopped the group after %d steps", steps)
            return
        if msg.kind is Kind.STEP:
            try:
                runner.forward(msg.items)
            except GroupFailed:
                raise
            except Exception as e:  # the ranks may now wait at different collectives: leave now
                log.exception("a step failed on this rank after %d steps", steps)
                raise GroupFailed(f"this rank's step raised: {e!r}") from e
            steps += 1
