"""The router's report of its workers: what a router serves at GET /internal/parity and the operator
reads, one router per service, for the HandoffVerified condition (the workers' parity standing) and
KVTransferReady (their KV health as the router's last poll of /internal/info found it, so the operator
never asks every worker itself). One definition for both sides.

Each router checks every prefill/decode pairing it routes through (router/parity/decisions.py): a fixed probe
goes through prefill-then-decode (the KV handed off over the real transport) and through the decode
worker alone, and the teacher-forced log probabilities of a fixed continuation are compared. A
worker's `state` says whether it may take part in a KV handoff.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

from tandem.contracts.kv_health import KVHealth

PARITY_PATH = "/internal/parity"

# How long after its verdict a router probes a worker again, by default (router --parity-recheck-s,
# the operator's rendered router config): a verdict is not forever (a volume repaired, a pod whose
# partner was the broken one), and one probe per worker every few minutes costs little.
RECHECK_S = 300.0


class ParityState(enum.StrEnum):
    """One worker's standing for KV handoffs, as its router's probes found it."""

    UNCHECKED = "unchecked"  # no probe yet (waiting for a partner of the other role, or its turn)
    VERIFIED = "verified"  # its last probe agreed: it takes part in handoffs
    MISMATCH = "mismatch"  # a probe disagreed beyond the tolerance: no handoff to or from it
    FAILED = "failed"  # the probe could not finish (an error, a timeout): retried, no handoff meanwhile


class ProbeOutcome(enum.StrEnum):
    MATCH = "match"
    MISMATCH = "mismatch"
    ERROR = "error"


@dataclass
class ProbeResult:
    """One probe of a (prefill, decode) pair."""

    prefill: str  # worker URLs
    decode: str
    kv_compat: str
    outcome: ProbeOutcome
    max_abs_diff: float | None = None  # max over the continuation of |logprob(handoff) - logprob(alone)|
    tolerance: float = 0.0
    dtype: str = ""
    tokens: int = 0  # continuation tokens compared
    message: str = ""
    seconds: float = 0.0  # how long the probe took
    at_unix: float = 0.0
    seed: int = 0  # the probe's tokens (router/parity/decisions.py probe_tokens)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ProbeResult:
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in d.items() if k in known}
        values["outcome"] = ProbeOutcome(values["outcome"])
        return cls(**values)


@dataclass
class WorkerParity:
    """One worker in a router's report: its standing and the probe that set it."""

    url: str
    role: str
    kv_compat: str
    state: ParityState
    checking: bool = False  # a probe of it is running now
    last: ProbeResult | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorkerParity:
        last = d.get("last")
        return cls(url=str(d["url"]), role=str(d["role"]), kv_compat=str(d.get("kv_compat", "")),
                   state=ParityState(d["state"]), checking=bool(d.get("checking", False)),
                   last=ProbeResult.from_dict(last) if isinstance(last, dict) else None)


@dataclass
class ParityReport:
    """GET /internal/parity. `enabled` false: the router does not probe (every pairing is used
    unchecked, as before the probe existed); it still reports its workers' KV health."""

    enabled: bool
    workers: list[WorkerParity] = field(default_factory=list)
    probes_total: dict[str, int] = field(default_factory=dict)  # by ProbeOutcome
    # worker URL -> its KV health, from the router's last poll of it (workers of a runtime without
    # one are absent); unreachable: worker URL -> why the router's last poll of it failed.
    kv_health: dict[str, KVHealth] = field(default_factory=dict)
    unreachable: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ParityReport:
        """Parse a router's answer; unknown keys (a newer router) are ignored; ValueError/KeyError/
        TypeError for a document that is not one."""
        if not isinstance(d.get("enabled"), bool) or not isinstance(d.get("workers", []), list):
            raise ValueError("not a parity report")
        totals = d.get("probes_total") or {}
        health = d.get("kv_health") or {}
        unreachable = d.get("unreachable") or {}
        if not isinstance(health, dict) or not isinstance(unreachable, dict):
            raise ValueError("not a parity report")
        return cls(enabled=d["enabled"], workers=[WorkerParity.from_dict(w) for w in d.get("workers", [])],
                   probes_total={str(k): int(v) for k, v in totals.items()},
                   kv_health={str(url): KVHealth.from_dict(h) for url, h in health.items()},
                   unreachable={str(url): str(why) for url, why in unreachable.items()})
