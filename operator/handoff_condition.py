"""HandoffVerified: what the routers' handoff parity probes found, as one condition. Pure.

Every ready router pod reports at GET /internal/parity (tandem.contracts.handoff_parity) which
workers it has proven for KV handoffs. The condition speaks of the service's ready prefill and decode
pods only (a report naming a pod that is gone or not ready is not held against the service), takes a
worker's worst standing over the routers, and names pods so `kubectl describe` points at them:

  False    ParityMismatch  a probe found a worker disagreeing: handoffs to and from it stopped (its
                           requests are prefilled on the decode pool), with the measured difference
  Unknown  ProbeFailed     a probe could not finish (retried by the router), with its error
  Unknown  Unreachable     a router's report could not be read
  Unknown  Checking        a ready worker has no verdict yet
  Unknown  NoPairing       no ready prefill pod: nothing is handed off, nothing to prove
  Unknown  NoRouters / NoWorkers / NotProbed
  True     Verified        every ready worker proven, with the largest difference measured

Like KVTransferReady it does not feed Ready (decode-side prefill still serves); turning ParityMismatch
posts one Warning event (tandem.operator.reconcile).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.contracts.handoff_parity import ParityReport, ParityState, WorkerParity
from tandem.contracts.names import Role, pod_ready, pod_url

if TYPE_CHECKING:  # status.py builds every condition, this one included
    from tandem.operator.status import Observation

TYPE = "HandoffVerified"
_WORST = {ParityState.VERIFIED: 0, ParityState.UNCHECKED: 1, ParityState.FAILED: 2, ParityState.MISMATCH: 3}


@dataclass
class RouterParity:
    """One ready router pod's parity report (None when it could not be read, `error` says why)."""

    pod: str
    report: ParityReport | None = None
    error: str | None = None


def _cond(status: str, reason: str, message: str) -> dict[str, str]:
    return {"type": TYPE, "status": status, "reason": reason, "message": message}


def _ready_workers(obs: Observation) -> dict[str, tuple[str, str]]:
    """Worker URL -> (pod name, role) for the ready prefill and decode pods."""
    out = {}
    for role in (Role.PREFILL.value, Role.DECODE.value):
        ro = obs.roles.get(role)
        for pod in ro.pods if ro else []:
            url = pod_url(pod)
            if url is not None and pod_ready(pod):
                out[url] = (pod["metadata"]["name"], role)
    return out


def _worst(reads: list[RouterParity], ready: dict[str, tuple[str, str]]) -> dict[str, WorkerParity]:
    """Each ready worker's worst standing over the routers' reports."""
    out: dict[str, WorkerParity] = {}
    for read in reads:
        for w in read.report.workers if read.report else []:
            if w.url in ready and (w.url not in out or _WORST[w.state] > _WORST[out[w.url].state]):
                out[w.url] = w
    return out


def _name(url: str, ready: dict[str, tuple[str, str]]) -> str:
    pod, role = ready.get(url, (url, "worker"))
    return f"pod {pod} ({role})"


def handoff_condition(obs: Observation, reads: list[RouterParity] | None) -> dict[str, str]:
    """HandoffVerified from the routers' reports (None: the operator does not probe)."""
    if reads is None:
        return _cond("Unknown", "NotProbed", "the operator does not probe (--no-kv-probe); see the "
                         "routers' /internal/parity")
    if not reads:
        return _cond("Unknown", "NoRouters", "no router pod is ready to report handoff parity")
    enabled = [r for r in reads if r.report is not None and r.report.enabled]
    if all(r.report is not None and not r.report.enabled for r in reads):
        return _cond("Unknown", "NotProbed", "the routers do not probe handoffs (--no-parity-probe): "
                         "every pairing takes KV unproven")
    ready = _ready_workers(obs)
    if not ready:
        return _cond("Unknown", "NoWorkers", "no prefill or decode pod is ready")
    found = _worst(enabled, ready)
    bad = [w for w in found.values() if w.state is ParityState.MISMATCH]
    if bad:
        parts = [f"{_name(w.url, ready)}: {w.last.message if w.last else 'disagreed'}" for w in bad]
        return _cond("False", "ParityMismatch",
                         "KV handoffs stopped for workers whose probe disagreed (their requests are prefilled "
                         "on the decode pool): " + "; ".join(sorted(parts)))
    failed = [w for w in found.values() if w.state is ParityState.FAILED]
    if failed:
        parts = [f"{_name(w.url, ready)}: {w.last.message if w.last else 'failed'}" for w in failed]
        return _cond("Unknown", "ProbeFailed", "a handoff parity probe could not finish (the router "
                         "retries): " + "; ".join(sorted(parts)))
    unreadable = [r for r in reads if r.report is None]
    if unreadable:
        return _cond("Unknown", "Unreachable", "cannot read /internal/parity of " + "; ".join(
            f"router pod {r.pod}: {r.error}" for r in unreadable))
    if all(role != Role.PREFILL.value for _, role in ready.values()):
        return _cond("Unknown", "NoPairing", "no prefill pod is ready: decode workers prefill every "
                         "prompt, no KV is handed off")
    waiting = [url for url in ready if url not in found or found[url].state is not ParityState.VERIFIED]
    if waiting:
        return _cond("Unknown", "Checking", "waiting for a handoff parity probe of " + ", ".join(
            sorted(_name(u, ready) for u in waiting)))
    return _cond("True", "Verified", _verified(list(found.values())))


def _verified(workers: list[WorkerParity]) -> str:
    diffs = [w.last.max_abs_diff for w in workers if w.last and w.last.max_abs_diff is not None]
    tolerances = {(w.last.dtype or "unknown dtype", w.last.tolerance) for w in workers if w.last}
    limits = ", ".join(f"{t:g} for {d}" for d, t in sorted(tolerances))
    return (f"{len(workers)} workers proven for KV handoffs: largest |logprob difference| "
            f"{max(diffs, default=0.0):.3g} (tolerance {limits})")
