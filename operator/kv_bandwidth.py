"""The KV handoff bandwidth the workers measure, per transport, and the floor spec.kvTransfer's
`minBandwidthGBps` sets under it. Pure; tandem.operator.status.kv_condition says it in KVTransferReady.

Each worker reports the effective bandwidth of its recent timed transfers (/internal/kv/health
`recent_bandwidth_bytes_per_second`: bytes over seconds of its last 32 pulls, or serves where its
backend times them). A pod that says RDMA but moves KV at TCP speed is the most common silent
failure in this field, so a worker below the floor turns KVTransferReady False, naming what it
measured and the usual causes. Figures in messages are rounded down to a step of a geometric series
(10 per decade), so status is rewritten when a figure really moves, not at every probe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # status.py builds KVTransferReady from these findings
    from tandem.operator.status import KVProbe

GB = 1e9
USUAL_CAUSES = ("the usual causes: NIXL/UCX fell back to TCP (UCX_TLS without an RDMA transport, or no RDMA "
                "device in the pod), a wrong UCX_IB_ADDR_TYPE (RoCE needs eth), UCX_NET_DEVICES naming a "
                "bonded device instead of an mlx5 port")


@dataclass(frozen=True)
class Measured:
    pod: str
    role: str
    path: str  # "<backend> over <network>", e.g. "nixl over rdma"
    gbps: float
    transfers: int


def about(gbps: float) -> str:
    """`gbps` rounded down to 10 steps per decade (1, 1.3, 1.6, 2, 2.5, 3.2, 4, 5, 6.3, 7.9)."""
    if gbps <= 0 or not math.isfinite(gbps):
        return f"{gbps:g} GB/s"
    step = math.floor(math.log10(gbps) * 10 + 1e-9) / 10
    return f"{10 ** step:.2g} GB/s"


def measured(probes: list[KVProbe]) -> list[Measured]:
    """Every worker that has timed transfers recently, with its path and bandwidth."""
    out = []
    for p in probes:
        h = p.health
        if h is None or not h.recent_bandwidth_bytes_per_second or not h.recent_transfers:
            continue
        network = h.transport.network if h.transport else "unknown"
        out.append(Measured(p.pod, p.role, f"{h.backend} over {network}",
                            h.recent_bandwidth_bytes_per_second / GB, h.recent_transfers))
    return sorted(out, key=lambda m: (m.path, m.pod))


def summary(found: list[Measured]) -> str:
    """Per transport, the slowest worker's figure: 'KV handoffs measured: tcp over tcp ~1.6 GB/s'."""
    by_path: dict[str, list[Measured]] = {}
    for m in found:
        by_path.setdefault(m.path, []).append(m)
    parts = [f"{path} ~{about(min(ms, key=lambda m: m.gbps).gbps)} (slowest of {len(ms)})"
             for path, ms in sorted(by_path.items())]
    return "KV handoffs measured: " + "; ".join(parts)


def below_floor(found: list[Measured], floor_gbps: float | None) -> str | None:
    """KVTransferReady's message when a worker measured less than the floor; None otherwise."""
    if floor_gbps is None:
        return None
    slow = [m for m in found if m.gbps < floor_gbps]
    if not slow:
        return None
    parts = [f"pod {m.pod} ({m.role}) moves KV over {m.path} at ~{about(m.gbps)} (last {m.transfers} transfers)"
             for m in slow]
    return (f"KV handoff bandwidth below kvTransfer.minBandwidthGBps {floor_gbps:g}: " + "; ".join(parts)
            + f"; {USUAL_CAUSES}")
