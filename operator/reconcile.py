"""One reconcile of one InferenceService: render, apply, observe, write status, report events.

Level-triggered: every caller (create/update/resume handlers, the periodic resync, child
events) ends up here or in refresh_status, and running it twice changes nothing the second time.
The spec is parsed once per pass into the typed InferenceServiceSpec; one the operator cannot
use (a CRD older than the operator lets more through) applies nothing and says why in Ready.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import threading
import time

from kubernetes import client
from tandem.operator import apply
from tandem.operator.config import OperatorConfig
from tandem.operator.render import endpoint, generation_hash, internal_secret, render
from tandem.operator.spec import InferenceServiceSpec, SpecError
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


def parse_spec(body: dict) -> tuple[InferenceServiceSpec | None, str | None]:
    """(the typed spec, None), or (None, why the operator cannot use it)."""
    try:
        return InferenceServiceSpec.from_dict(body.get("spec")), None
    except SpecError as e:
        return None, str(e)


def _status(api: client.ApiClient, body: dict, spec: InferenceServiceSpec | None,
            config: OperatorConfig, generation: int | None, **findings: object) -> dict:
    """Observes the children and computes status; `findings` are Observation fields
    (apply_error, spec_error, kv_probes) that the caller knows and the API server does not."""
    meta = body["metadata"]
    obs = dataclasses.replace(apply.observe(api, meta["namespace"], meta["name"]), **findings)
    old = body.get("status") or {}
    if generation is None:
        generation = old.get("observedGeneration")
    if spec is None:  # what runs came from an earlier spec: keep what status said of it
        url, label = old.get("endpoint"), old.get("generation")
    else:
        url, label = endpoint(meta["name"], meta["namespace"], spec), generation_hash(spec, config)
    return compute_status(spec, obs, old, now(), generation, url, label)


def reconcile(api: client.ApiClient, body: dict, config: OperatorConfig,
              drift: bool = False, kv_probes: list[KVProbe] | None = None) -> apply.ApplyResult:
    """Applies every child and writes status; `drift` marks a periodic pass (event wording);
    `kv_probes` are the workers' KV health answers (None: not probed)."""
    meta = body["metadata"]
    spec, spec_error = parse_spec(body)
    if spec is None:
        result = apply.ApplyResult(error=spec_error)
    else:
        result = _apply(api, body, spec, config, drift)
    if result.error and _ready(body).get("message") != result.error:
        # Once per distinct failure, not per resync.
        reason = "InvalidSpec" if spec is None else "ApplyFailed"
        apply.post_event(api, body, "Warning", reason, result.error)
    # observedGeneration advances only once the spec it describes is applied.
    generation = None if result.error else meta.get("generation")
    apply_error = None if spec is None else result.error
    status = _status(api, body, spec, config, generation,
                     apply_error=apply_error, spec_error=spec_error, kv_probes=kv_probes)
    _kv_event(api, body, status)
    if not same_status(body.get("status"), status):
        apply.write_status(api, meta["namespace"], meta["name"], status, body.get("status"))
    return result


def _apply(api: client.ApiClient, body: dict, spec: InferenceServiceSpec, config: OperatorConfig,
           drift: bool) -> apply.ApplyResult:
    """Renders and applies every child; posts Created/Updated/DriftCorrected events."""
    meta = body["metadata"]
    t0 = time.monotonic()
    secret = internal_secret(meta)
    result = apply.ensure_internal_secret(api, secret)
    if not result.error:  # the Secret exists before any pod that mounts it
        applied = apply.apply_all(api, render(meta, spec, config))
        result = dataclasses.replace(applied, created=result.created + applied.created)
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
    spec, spec_error = parse_spec(body)
    status = _status(api, body, spec, config, None,
                     apply_error=apply_error, spec_error=spec_error, kv_probes=kv_probes)
    _kv_event(api, body, status)
    if not same_status(old, status):
        apply.write_status(api, namespace, name, status, old)
