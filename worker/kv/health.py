"""KV transfer health: what an operator needs to tell a working handoff path from a wedged one.

One TransferHealth per transport records every pull (decode side) and every
serve (prefill side): last success, failures, the effective bandwidth of recent
transfers, and which network transport UCX would use (so a silent fallback from
RDMA to TCP is visible, reference.md). The same figures go to Prometheus through
the KVTransferMetrics the worker passes in (config.extra["kv_metrics"], made once
in its registry), which several transports in one process (tests, benchmarks)
share, told apart by the `backend` and `direction` labels (never per request).
"""

from __future__ import annotations

import collections
import os
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from tandem.contracts.kv_health import KVHealth, TransportInfo

# UCX transport names that move bytes over RDMA hardware (verbs, mlx5 accelerated, EFA).
RDMA_TLS = {"rc", "rc_v", "rc_x", "rc_verbs", "rc_mlx5", "dc", "dc_x", "dc_mlx5", "ud", "ud_v",
            "ud_x", "ud_verbs", "ud_mlx5", "ib", "srd", "mlx5"}


class KVTransferMetrics:
    """The tandem_kv_transfer_* metrics, registered once in one registry. The registry's owner
    makes them (the worker's WorkerMetrics) and hands them to every transport of the process
    (config.extra["kv_metrics"]), which are told apart by their labels; a transport given none
    counts in a registry of its own, which nobody scrapes."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ["backend", "direction"]
        self.bytes_total = Counter("tandem_kv_transfer_bytes_total", "KV cache bytes moved between workers",
                                   labels, registry=self.registry)
        self.seconds = Histogram("tandem_kv_transfer_seconds",
                                 "Duration of one KV handoff (metadata, transfer and completion signal)",
                                 labels, registry=self.registry,
                                 buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                          0.5, 1.0, 2.5, 5.0, 10.0, 30.0))
        self.failures_total = Counter("tandem_kv_transfer_failures_total",
                                      "KV handoffs that failed (peer gone, transfer error, timeout)",
                                      labels, registry=self.registry)
        self.last_success = Gauge("tandem_kv_transfer_last_success_timestamp_seconds",
                                  "Unix time of the last successful KV handoff", labels, registry=self.registry)
        self.rdma = Gauge("tandem_kv_transfer_rdma_in_use",
                          "1 when the KV transport moves bytes over RDMA, 0 when it uses TCP or memory",
                          ["backend"], registry=self.registry)


def detect_ucx_transport(env: dict[str, str] | None = None,
                         sysfs: Path = Path("/sys/class/infiniband")) -> TransportInfo:
    """Which network transport UCX will pick, from the UCX settings in effect and the RDMA devices present.

    UCX uses RDMA only when its UCX_TLS allows an RDMA transport (unset or "all"
    allows every one) AND an RDMA device exists (listed in /sys/class/infiniband,
    and matching UCX_NET_DEVICES when set); otherwise it falls back to TCP.
    """
    env = dict(os.environ if env is None else env)
    tls_raw = env.get("UCX_TLS", "")
    tls = [t.strip() for t in tls_raw.split(",") if t.strip()]
    excluded = bool(tls) and tls[0].startswith("^")
    names = {t.lstrip("^") for t in tls}
    try:
        devices = sorted(p.name for p in sysfs.iterdir())
    except OSError:
        devices = []
    net_devices = env.get("UCX_NET_DEVICES", "")
    if net_devices and net_devices != "all":
        wanted = {d.split(":")[0] for d in net_devices.split(",")}
        devices = [d for d in devices if d in wanted]
    if not tls or names == {"all"}:
        tls_allows_rdma = True
    elif excluded:
        tls_allows_rdma = not (names & RDMA_TLS)
    else:
        tls_allows_rdma = bool(names & RDMA_TLS)
    rdma = tls_allows_rdma and bool(devices)
    if rdma:
        reason = f"RDMA devices {devices} and UCX_TLS={tls_raw or '<unset>'} allows RDMA"
    elif not devices:
        reason = "no RDMA device in /sys/class/infiniband (or none matching UCX_NET_DEVICES): UCX uses TCP"
    else:
        reason = f"UCX_TLS={tls_raw} excludes every RDMA transport: UCX uses TCP"
    return TransportInfo(
        rdma=rdma,
        network="rdma" if rdma else "tcp",
        ucx_tls=tls_raw or None,
        ucx_net_devices=net_devices or None,
        rdma_devices=devices,
        detected_by="UCX_TLS/UCX_NET_DEVICES in the environment + RDMA devices in /sys/class/infiniband",
        reason=reason,
    )


class TransferHealth:
    """Counters and recent samples behind /internal/kv/health and the tandem_kv_transfer_* metrics."""

    RECENT = 32  # transfers averaged for the effective bandwidth

    def __init__(self, backend: str, engine_id: str, metrics: KVTransferMetrics | None = None,
                 transport: TransportInfo | None = None):
        self.backend = backend
        self.engine_id = engine_id
        self.metrics = metrics if metrics is not None else KVTransferMetrics()
        self.transport = transport or TransportInfo(
            rdma=False, network=backend, detected_by=f"the {backend} backend never uses RDMA")
        self.metrics.rdma.labels(backend).set(1 if self.transport.rdma else 0)
        self.started_at = time.time()
        self.last_success: float | None = None
        self.last_failure: float | None = None
        self.last_error: str | None = None
        self.successes = collections.Counter[str]()
        self.failures = collections.Counter[str]()
        self.bytes = collections.Counter[str]()
        self._recent: collections.deque[tuple[int, float]] = collections.deque(maxlen=self.RECENT)

    def success(self, direction: str, nbytes: int, seconds: float | None = None) -> None:
        """Record a completed handoff; `seconds` only where this side timed the bytes moving."""
        now = time.time()
        self.last_success = now
        self.successes[direction] += 1
        self.bytes[direction] += nbytes
        labels = (self.backend, direction)
        self.metrics.bytes_total.labels(*labels).inc(nbytes)
        self.metrics.last_success.labels(*labels).set(now)
        if seconds is not None:
            self.metrics.seconds.labels(*labels).observe(seconds)
            if nbytes:
                self._recent.append((nbytes, seconds))

    def failure(self, direction: str, error: str) -> None:
        self.last_failure = time.time()
        self.last_error = error
        self.failures[direction] += 1
        self.metrics.failures_total.labels(self.backend, direction).inc()

    def bandwidth(self) -> float | None:
        """Bytes per second over the recent transfers this side timed (None before the first)."""
        total_s = sum(s for _, s in self._recent)
        return sum(b for b, _ in self._recent) / total_s if total_s > 0 else None

    def report(self, peers: dict[str, str] | None = None, serving: int | None = None) -> KVHealth:
        now = time.time()
        # Healthy unless the latest event is a failure: one success after failures recovers it.
        healthy = self.last_failure is None or (self.last_success or 0) > self.last_failure
        return KVHealth(
            backend=self.backend,
            engine_id=self.engine_id,
            healthy=healthy,
            last_success_unix=self.last_success,
            seconds_since_last_success=None if self.last_success is None else now - self.last_success,
            last_failure_unix=self.last_failure,
            last_error=self.last_error,
            transfers_total=dict(self.successes),
            failures_total=dict(self.failures),
            bytes_total=dict(self.bytes),
            recent_bandwidth_bytes_per_second=self.bandwidth(),
            recent_transfers=len(self._recent),
            transport=self.transport,
            peers=dict(peers or {}),
            serving=serving,
        )
