"""One reconcile of one InferenceService: render, apply, observe, write status, report events.

Level-triggered: every caller (create/update/resume handlers, the periodic resync, child
events) ends up here or in refresh_status, and running it twice changes nothing the second time.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time

from kubernetes import client
from tandem.operator import apply
from tandem.operator.config import OperatorConfig
from tandem.operator.render import endpoint, generation_hash, render
from tandem.operator.status import KVProbe, compute_status, same_status

log = logging.getLogger(__name__)


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _ready(body: dict) -> dict:
    conditions = (body.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == "Ready"), {})


# KVTransferReady reasons that earn a Warning event, once per transition into them.
KV_WARNINGS = ("RDMAFallback", "TransferFailing")


def _kv(status: dict | None) -> dict:
    conditions = (status or {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == "KVTransferReady"), {})


# The last KVTransferReady reason seen per (namespace, name): a resync and a child-event refresh
# may run at once from the same stale status, and must not both post the event.
_kv_seen: dict[tuple[str, str], str] = {}
_kv_lock = threading.Lock()


def _kv_event(api: client.ApiClient, body: dict, new_status: dict) -> None:
    """A Warning when KV transfer turns bad (not on every resync while it stays bad)."""
    old, new = _kv(body.get("status")), _kv(new_status)
    key = (body["metadata"]["namespace"], body["metadata"]["name"])
    with _kv_lock:
        seen, _kv_seen[key] = _kv_seen.get(key), new.get("reason", "")
    if new.get("reason") in KV_WARNINGS and new.get("reason") not in (old.get("reason"), seen):
        apply.post_event(api, body, "Warning", new["reason"], new["message"])


def _status(api: client.ApiClient, body: dict, config: OperatorConfig, generation: int | None,
            apply_error: str | None, kv_probes: list[KVProbe] | None) -> dict:
    meta, spec = body["metadata"], body["spec"]
    obs = apply.observe(api, meta["namespace"], meta["name"])
    obs.apply_error = apply_error
    obs.kv_probes = kv_probes
    old = body.get("status") or {}
    if generation is None:
        generation = old.get("observedGeneration")
    return compute_status(
        spec, obs, old, now(), generation,
        endpoint(meta["name"], meta["namespace"], spec), generation_hash(spec, config),
    )


def reconcile(api: client.ApiClient, body: dict, config: OperatorConfig,
              drift: bool = False, kv_probes: list[KVProbe] | None = None) -> apply.ApplyResult:
    """Applies every child and writes status; `drift` marks a periodic pass (event wording);
    `kv_probes` are the workers' KV health answers (None: not probed)."""
    meta = body["metadata"]
    t0 = time.monotonic()
    manifests = render(meta, body["spec"], config)
    result = apply.apply_all(api, manifests)
    if result.created or result.updated or result.error:
        log.info("applied %s/%s in %.2fs: %d created, %d updated%s", meta["namespace"], meta["name"],
                 time.monotonic() - t0, len(result.created), len(result.updated),
                 f"; failed: {result.error}" if result.error else "")
    # A periodic pass that applies a spec for the first time is not correcting drift.
    drift = drift and (body.get("status") or {}).get("observedGeneration") == meta.get("generation")

    def event(type_: str, reason: str, message: str) -> None:
        apply.post_event(api, body, type_, reason, message)

    if result.created:
        reason = "DriftCorrected" if drift else "Created"
        event("Normal", reason, "created " + ", ".join(result.created))
    if result.updated:
        reason = "DriftCorrected" if drift else "Updated"
        event("Normal", reason, "updated " + ", ".join(result.updated))
    if result.error and _ready(body).get("message") != result.error:
        event("Warning", "ApplyFailed", result.error)  # once per distinct failure, not per resync
    # observedGeneration advances only once the spec it describes is applied.
    generation = None if result.error else meta.get("generation")
    status = _status(api, body, config, generation, result.error, kv_probes)
    _kv_event(api, body, status)
    if not same_status(body.get("status"), status):
        apply.write_status(api, meta["namespace"], meta["name"], status, body.get("status"))
    return result


def refresh_status(api: client.ApiClient, namespace: str, name: str, config: OperatorConfig,
                   kv_probes: list[KVProbe] | None = None) -> None:
    """Re-reads the CR and its children and writes status if it changed (after a child event)."""
    body = apply.get_service(api, namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return
    old = body.get("status") or {}
    ready = _ready(body)
    apply_error = ready["message"] if ready.get("reason") == "ApplyFailed" else None
    status = _status(api, body, config, None, apply_error, kv_probes)
    _kv_event(api, body, status)
    if not same_status(old, status):
        apply.write_status(api, namespace, name, status, old)
