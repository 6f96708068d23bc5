"""Leader election on a coordination.k8s.io/v1 Lease, the decision part. Pure: the caller passes the
clock and does the I/O (tandem.operator.leader).

kopf's peering is no election (a peer with a higher priority pauses the others, by heartbeats in its
own cluster-wide CRDs), so two operator replicas elect a leader the way client-go's leaderelection
does: one Lease names the holder, who renews it every few seconds; a candidate takes it when it is
free, released, or has not been renewed for leaseDurationSeconds as measured on the candidate's own
clock (from when it last saw the record change, so clock skew between nodes does not matter); every
write carries the resourceVersion it read, so of two candidates at once only one wins.

The leader stops leading `renew_deadline_s` after the start of its last successful renewal
(`leading_until`), whatever its calls to the API server do meanwhile: a standby may take the Lease
`duration_s` after it saw that renewal, which cannot come before the renewal was sent, so the two
never lead at once. Every call of a renewal is bounded by the time left (`call_timeout`), and a call
that fails, however it fails, is a failed renewal (`renewal`), not an exit.
"""

from __future__ import annotations

import datetime
import enum
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ElectionConfig:
    """Where the Lease is and its timing (client-go's defaults: 15 s, 10 s, 2 s)."""

    namespace: str
    name: str = "tandem-operator"
    duration_s: int = 15
    renew_deadline_s: float = 10.0
    retry_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.retry_s < self.renew_deadline_s < self.duration_s:
            raise ValueError("leader election needs retry < renew deadline < lease duration, got "
                             f"{self.retry_s} s, {self.renew_deadline_s} s, {self.duration_s} s")


class Verdict(enum.StrEnum):
    """What a candidate does with the Lease as it read it."""

    CREATE = "create"  # there is no Lease: create it, holding it
    TAKE = "take"  # free, released or expired: write ourselves in as holder
    RENEW = "renew"  # ours: write a new renewTime
    WAIT = "wait"  # someone else holds it and renews it


@dataclass(frozen=True)
class Record:
    """The Lease's spec as it matters here, and the resourceVersion it was read at."""

    holder: str | None
    duration_s: int
    acquire_time: str | None = None
    renew_time: str | None = None
    transitions: int = 0
    resource_version: str | None = None

    @classmethod
    def of(cls, lease: dict[str, Any]) -> Record:
        spec = lease.get("spec") or {}
        return cls(spec.get("holderIdentity") or None, int(spec.get("leaseDurationSeconds") or 0),
                   spec.get("acquireTime"), spec.get("renewTime"), int(spec.get("leaseTransitions") or 0),
                   (lease.get("metadata") or {}).get("resourceVersion"))

    @property
    def seen(self) -> tuple[str | None, str | None, int]:
        """What changes when anyone writes the Lease: a candidate times expiry from its last change."""
        return self.holder, self.renew_time, self.transitions


def judge(record: Record | None, me: str, changed_at: float, now: float) -> Verdict:
    """The candidate `me`'s move; `changed_at` is when it saw `record.seen` change (its own clock)."""
    if record is None:
        return Verdict.CREATE
    if record.holder == me:
        return Verdict.RENEW
    if record.holder is None or now - changed_at >= max(record.duration_s, 1):
        return Verdict.TAKE
    return Verdict.WAIT


def micro_time(when: datetime.datetime) -> str:
    """A Kubernetes MicroTime."""
    return when.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def claim(record: Record | None, me: str, duration_s: int, verdict: Verdict, when: datetime.datetime) -> dict:
    """The Lease spec `me` writes for `verdict` (CREATE, TAKE or RENEW)."""
    stamp = micro_time(when)
    spec: dict[str, Any] = {"holderIdentity": me, "leaseDurationSeconds": duration_s, "renewTime": stamp}
    if verdict is Verdict.RENEW and record is not None:
        spec |= {"acquireTime": record.acquire_time or stamp, "leaseTransitions": record.transitions}
    else:
        changed = record is not None and record.holder not in (None, me)
        transitions = (record.transitions if record else 0) + (1 if changed else 0)
        spec |= {"acquireTime": stamp, "leaseTransitions": transitions}
    return spec


def release(record: Record, when: datetime.datetime) -> dict:
    """The spec a leader writes as it stops: no holder, so a candidate takes it at once."""
    return {"holderIdentity": None, "leaseDurationSeconds": 1, "renewTime": micro_time(when),
            "acquireTime": record.acquire_time, "leaseTransitions": record.transitions}


class Renewal(enum.StrEnum):
    """What one renewal attempt of the leader came to."""

    RENEWED = "renewed"  # the Lease is written with a new renewTime: leading until leading_until()
    FAILED = "failed"  # an error, a timeout, a conflict: try again, until the deadline
    TAKEN = "taken"  # another candidate holds the Lease now: stop leading at once


def renewal(held: bool | None, holder: str | None, me: str) -> Renewal:
    """`held`: whether the attempt wrote the Lease (None: a call raised, whatever it raised);
    `holder`: the holder it last read."""
    if held:
        return Renewal.RENEWED
    if held is False and holder not in (None, me):
        return Renewal.TAKEN
    return Renewal.FAILED


def leading_until(renewed_at: float, config: ElectionConfig) -> float:
    """When a leader whose last successful renewal was sent at `renewed_at` (its own monotonic
    clock) stops leading: the renew deadline after it, which leaves duration - deadline for the stop
    before a standby, timing from when it saw that renewal, may take the Lease."""
    return renewed_at + config.renew_deadline_s


def attempt_until(started: float, renewed_at: float, config: ElectionConfig) -> float:
    """When a renewal attempt started at `started` must be over: one retry period, never past the
    deadline."""
    return min(started + config.retry_s, leading_until(renewed_at, config))


MIN_CALL_S = 0.05  # a call with less time than this left is not made: it would only time out


def call_timeout(now: float, until: float) -> float | None:
    """The timeout of one API call made at `now` that must be over by `until`; its connect and its
    read are each bounded by it, hence half the time left. None: too little time left to call."""
    left = until - now
    return left / 2 if left >= 2 * MIN_CALL_S else None
