"""One reconcile of one InferenceService: render, apply, observe, write status, report events.

Level-triggered: every caller (create/update/resume handlers, the periodic resync, child
events, the autoscaler) ends up here or in refresh_status, and running it twice changes nothing
the second time. The spec is parsed once per pass into the typed InferenceServiceSpec; one the
operator cannot use (a CRD older than the operator lets more through) applies nothing and says
why in Ready.

Status holds state: the planner's desired replicas for an autoscaled role (see
tandem.operator.autoscaling.status). So every pass reads the InferenceService afresh under a lock
per service, and the autoscaler writes its decisions under the same lock: no pass applies, or
writes back, a status older than the newest decision.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import threading
import time
from collections.abc import Iterator

from kubernetes import client
from tandem.operator import apply, model_check
from tandem.operator.autoscaling.planner import Decision
from tandem.operator.autoscaling.status import render_replicas, scaling_status
from tandem.operator.config import OperatorConfig
from tandem.operator.render import (
    endpoint,
    generation_hash,
    internal_secret,
    render,
    stale_workloads,
)
from tandem.operator.spec import InferenceServiceSpec, SpecError
from tandem.operator.status import KVProbe, compute_status, same_status

log = logging.getLogger(__name__)


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_guard = threading.Lock()


@contextlib.contextmanager
def service_lock(namespace: str, name: str) -> Iterator[None]:
    """One pass at a time per InferenceService (reconciles run in threads, the autoscaler too)."""
    with _locks_guard:
        lock = _locks.setdefault((namespace, name), threading.Lock())
    with lock:
        yield


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
            config: OperatorConfig, generation: int | None, decision: Decision | None = None,
            model: model_check.ModelFinding | None = None, **findings: object) -> dict:
    """Observes the children and computes status; `findings` are Observation fields
    (apply_error, spec_error, kv_probes) that the caller knows and the API server does not;
    `decision` is the planner's, when one was just made; `model` what model_check found."""
    meta = body["metadata"]
    obs = dataclasses.replace(apply.observe(api, meta["namespace"], meta["name"]), **findings)
    old = body.get("status") or {}
    if generation is None:
        generation = old.get("observedGeneration")
    if model is not None:
        spec = model.spec  # a hub model pinned to its commit: the generation the pods carry
    if spec is None or (model is not None and model.blocking):
        # What runs came from an earlier spec: keep what status said of it.
        url, label = old.get("endpoint"), old.get("generation")
        url = url if spec is None else endpoint(meta["name"], meta["namespace"], spec)
    else:
        url, label = endpoint(meta["name"], meta["namespace"], spec), generation_hash(spec, config)
    stamp = now()
    scaling = scaling_status(spec, obs, old, stamp, decision)
    found = (model.status, model.condition) if model is not None else None
    return compute_status(spec, obs, old, stamp, generation, url, label, scaling, found)


def reconcile(api: client.ApiClient, body: dict, config: OperatorConfig,
              drift: bool = False, kv_probes: list[KVProbe] | None = None) -> apply.ApplyResult:
    """Applies every child and writes status; `drift` marks a periodic pass (event wording);
    `kv_probes` are the workers' KV health answers (None: not probed). `body` names the
    InferenceService; it is read afresh (its status may hold a newer decision of the planner)."""
    meta = body["metadata"]
    with service_lock(meta["namespace"], meta["name"]):
        fresh = apply.get_service(api, meta["namespace"], meta["name"])
        if fresh is None or fresh["metadata"].get("deletionTimestamp"):
            return apply.ApplyResult()
        return reconcile_locked(api, fresh, config, drift, kv_probes)


def reconcile_locked(api: client.ApiClient, body: dict, config: OperatorConfig, drift: bool = False,
                     kv_probes: list[KVProbe] | None = None, announce: bool = True) -> apply.ApplyResult:
    """reconcile() for a caller that holds service_lock and has just read `body`; `announce` False
    posts no Created/Updated events (the autoscaler posts its own for a change of replicas)."""
    meta = body["metadata"]
    spec, spec_error = parse_spec(body)
    model = model_check.check(api, body, spec, config) if spec is not None else None
    if spec is None:
        result = apply.ApplyResult(error=spec_error)
    elif model is not None and model.blocking:
        result = apply.ApplyResult()  # nothing is applied: no pod downloads a model it cannot serve
        _model_event(api, body, model)
    else:
        result = _apply(api, body, model.spec if model else spec, config, drift, announce)
    if result.error and _ready(body).get("message") != result.error:
        # Once per distinct failure, not per resync.
        reason = "InvalidSpec" if spec is None else "ApplyFailed"
        apply.post_event(api, body, "Warning", reason, result.error)
    # observedGeneration advances only once the spec it describes is applied.
    applied = not result.error and not (model is not None and model.blocking)
    generation = meta.get("generation") if applied else None
    apply_error = None if spec is None else result.error
    status = _status(api, body, spec, config, generation, model=model,
                     apply_error=apply_error, spec_error=spec_error, kv_probes=kv_probes)
    _kv_event(api, body, status)
    if not same_status(body.get("status"), status):
        apply.write_status(api, meta["namespace"], meta["name"], status, body.get("status"))
    return result


def _model_event(api: client.ApiClient, body: dict, model: model_check.ModelFinding) -> None:
    """A Warning when the model cannot be served, once per distinct message (not per resync)."""
    old = next((c for c in (body.get("status") or {}).get("conditions") or []
                if c.get("type") == model_check.TYPE), {})
    if old.get("message") != model.condition["message"]:
        apply.post_event(api, body, "Warning", model.condition["reason"], model.condition["message"])


def _apply(api: client.ApiClient, body: dict, spec: InferenceServiceSpec, config: OperatorConfig,
           drift: bool, announce: bool = True) -> apply.ApplyResult:
    """Renders and applies every child; posts Created/Updated/DriftCorrected events."""
    meta = body["metadata"]
    t0 = time.monotonic()
    secret = internal_secret(meta)
    result = apply.ensure_internal_secret(api, secret)
    if not result.error:  # the Secret exists before any pod that mounts it
        manifests = render(meta, spec, config, render_replicas(spec, body.get("status")))
        applied = apply.apply_all(api, manifests)
        result = dataclasses.replace(applied, created=result.created + applied.created)
    if not result.error:  # a role that changed kind (Deployment <-> LeaderWorkerSet): the old one goes
        result = _prune(api, meta, spec, result)
    if result.created or result.updated or result.error:
        log.info("applied %s/%s in %.2fs: %d created, %d updated%s", meta["namespace"], meta["name"],
                 time.monotonic() - t0, len(result.created), len(result.updated),
                 f"; failed: {result.error}" if result.error else "")
    # A periodic pass that applies a spec for the first time is not correcting drift.
    drift = drift and (body.get("status") or {}).get("observedGeneration") == meta.get("generation")

    def event(type_: str, reason: str, message: str) -> None:
        if announce:
            apply.post_event(api, body, type_, reason, message)

    if result.created:
        reason = "DriftCorrected" if drift else "Created"
        event("Normal", reason, "created " + ", ".join(result.created))
    if result.updated:
        reason = "DriftCorrected" if drift else "Updated"
        event("Normal", reason, "updated " + ", ".join(result.updated))
    return result


def _prune(api: client.ApiClient, meta: dict, spec: InferenceServiceSpec,
           result: apply.ApplyResult) -> apply.ApplyResult:
    try:
        deleted = apply.prune(api, meta["uid"], stale_workloads(meta, spec))
    except Exception as e:  # the API server failing: the next pass prunes
        log.warning("pruning the old workloads of %s/%s failed: %s", meta["namespace"], meta["name"], e)
        return result
    return dataclasses.replace(result, updated=result.updated + [f"{r} (deleted)" for r in deleted])


def refresh_status(api: client.ApiClient, namespace: str, name: str, config: OperatorConfig,
                   kv_probes: list[KVProbe] | None = None) -> None:
    """Re-reads the CR and its children and writes status if it changed (after a child event)."""
    with service_lock(namespace, name):
        body = apply.get_service(api, namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return
        write_status(api, body, config, kv_probes)


def write_status(api: client.ApiClient, body: dict, config: OperatorConfig,
                 kv_probes: list[KVProbe] | None = None, decision: Decision | None = None) -> dict:
    """Status recomputed from `body` (read under service_lock) and the children, with the planner's
    `decision` when one was just made; written if it changed. Returns the status."""
    meta, old = body["metadata"], body.get("status") or {}
    ready = _ready(body)
    apply_error = ready["message"] if ready.get("reason") == "ApplyFailed" else None
    spec, spec_error = parse_spec(body)
    status = _status(api, body, spec, config, None, decision, model=model_check.carried(body, spec),
                     apply_error=apply_error, spec_error=spec_error, kv_probes=kv_probes)
    _kv_event(api, body, status)
    if not same_status(old, status):
        apply.write_status(api, meta["namespace"], meta["name"], status, old)
    return status
