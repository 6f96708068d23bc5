"""The KV transfer health document: what a worker serves at /internal/kv/health and in its
/internal/info (WorkerInfo.kv_health), which its routers poll and pass on in their report
(ParityReport.kv_health) for the operator's KVTransferReady. One definition for every side."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TransportInfo:
    """What carries the KV bytes, and how that was found out (a silent RDMA -> TCP fallback shows here)."""

    rdma: bool
    network: str  # "rdma", "tcp", "memory"
    detected_by: str
    reason: str | None = None
    ucx_tls: str | None = None
    ucx_net_devices: str | None = None
    rdma_devices: list[str] = field(default_factory=list)
    nixl_backend: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TransportInfo:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass
class KVHealth:
    backend: str  # a KVBackend value
    engine_id: str = ""
    # None: this worker has no transport (still loading, or --kv-backend none): nothing to judge.
    # Otherwise healthy unless the latest transfer event is a failure.
    healthy: bool | None = None
    last_success_unix: float | None = None
    seconds_since_last_success: float | None = None
    last_failure_unix: float | None = None
    last_error: str | None = None
    transfers_total: dict[str, int] = field(default_factory=dict)  # by direction: pull, serve
    failures_total: dict[str, int] = field(default_factory=dict)
    bytes_total: dict[str, int] = field(default_factory=dict)
    recent_bandwidth_bytes_per_second: float | None = None
    recent_transfers: int = 0
    transport: TransportInfo | None = None
    peers: dict[str, str] = field(default_factory=dict)  # peer URL -> the engine_id last seen there
    serving: int | None = None  # tcp: reads being served now

    @property
    def failures(self) -> int:
        return sum(self.failures_total.values())

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVHealth:
        """Parse a worker's answer; unknown keys (a newer worker) are ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in d.items() if k in known}
        if isinstance(values.get("transport"), dict):
            values["transport"] = TransportInfo.from_dict(values["transport"])
        if not isinstance(values.get("backend"), str):
            raise ValueError("a KV health document names its backend")
        return cls(**values)
