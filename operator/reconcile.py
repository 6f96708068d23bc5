"""One pass over one InferenceService, in two halves around the observation of its children: `act`
(the planner's decision, the model check, render, apply) and `conclude` (status written once, events).
Each runs in a thread (the Kubernetes client is synchronous), called only by the work queue
(tandem.operator.controller), which runs one pass at a time per service: no lock.

Level-triggered: running a pass twice changes nothing the second time. The spec is parsed once per
pass into the typed InferenceServiceSpec; one the operator cannot use (a CRD older than the
operator lets more through) applies nothing and says why in Ready.

Status holds state: the planner's desired replicas for an autoscaled role (see
tandem.operator.autoscaling.status). The pass starts from a fresh read of the InferenceService, and
the planner's decisions are made and kept inside passes, so no pass applies, or writes back, a
status older than the newest decision.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time
from dataclasses import dataclass, field

from kubernetes import client
from tandem.operator import apply, children, model_check, policy
from tandem.operator.autoscaling.planner import Decision
from tandem.operator.autoscaling.status import (
    ScaleChange,
    planned_status,
    render_replicas,
    scale_changes,
    scaling_status,
)
from tandem.operator.config import OperatorConfig
from tandem.operator.group_pods import removed_by_scale_down
from tandem.operator.handoff_condition import RouterParity
from tandem.operator.observe import Owners, observe_download
from tandem.operator.ownership import REFUSED, secret_record
from tandem.operator.render import (
    endpoint,
    generation_hash,
    internal_secret,
    names,
    render,
    stale_workloads,
)
from tandem.operator.render.weights import download_job_name
from tandem.operator.spec import WORKER_ROLES, InferenceServiceSpec, SpecError
from tandem.operator.status import KVProbe, Observation, compute_status, same_status
from tandem.operator.work import Work

log = logging.getLogger(__name__)

# Condition reasons that earn a Warning event, once per transition into them. (A model refusal that
# applies nothing posts its own, once per message: _model_event.)
WARNINGS = {"KVTransferReady": ("RDMAFallback", "TransferFailing", "BandwidthBelowFloor"),
            "HandoffVerified": ("ParityMismatch",),
            model_check.TYPE: ("DownloadFailed", "ClaimNotFound", "ClaimSingleNode")}


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Memory:
    """What a pass remembers of the service between passes (kept by the controller, per service)."""

    # WARNINGS' conditions' reasons as last written: one Warning per transition
    warned: dict[str, str] = field(default_factory=dict)
    owners: Owners = field(default_factory=dict)  # the owner chain's ReplicaSets/StatefulSets, read once each
    applied: dict[str, children.Applied] = field(default_factory=dict)  # what each child was applied as
    pruned: tuple[str, ...] | None = None  # the stale kinds last pruned (a role changing kind prunes again)


def _condition(status: dict | None, type_: str) -> dict:
    conditions = (status or {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == type_), {})


def _warning_events(api: client.ApiClient, body: dict, new_status: dict, memory: Memory) -> None:
    """A Warning when KV transfer or a handoff's parity turns bad (not on every pass while it stays bad)."""
    for type_, reasons in WARNINGS.items():
        old, new = _condition(body.get("status"), type_), _condition(new_status, type_)
        seen, memory.warned[type_] = memory.warned.get(type_), new.get("reason", "")
        if new.get("reason") in reasons and new.get("reason") not in (old.get("reason"), seen):
            apply.post_event(api, body, "Warning", new["reason"], new["message"])


def parse_spec(body: dict) -> tuple[InferenceServiceSpec | None, str | None]:
    """(the typed spec, None), or (None, why the operator cannot use it)."""
    try:
        return InferenceServiceSpec.from_dict(body.get("spec")), None
    except SpecError as e:
        return None, str(e)


def _status(body: dict, spec: InferenceServiceSpec | None, config: OperatorConfig, generation: int | None,
            obs: Observation, decision: Decision | None = None, model: model_check.ModelFinding | None = None,
            **findings: object) -> dict:
    """Status from the observed children; `findings` are Observation fields (apply_error, spec_error,
    kv_probes) that the caller knows and the API server does not; `decision` is the planner's, when
    one was just made; `model` what model_check found."""
    meta = body["metadata"]
    obs = dataclasses.replace(obs, **findings)
    old = body.get("status") or {}
    if generation is None:
        generation = old.get("observedGeneration")
    if model is not None:
        spec = model.spec  # a hub model pinned to its commit: the generation the pods carry
    if spec is None:  # what runs came from an earlier spec: keep what status said of it
        url, label = old.get("endpoint"), old.get("generation")
    elif (model is not None and model.blocking) or findings.get("apply_reason") == policy.DENIED:
        # nothing of this spec was applied: the pods are older
        url, label = endpoint(meta["name"], meta["namespace"], spec), old.get("generation")
    else:
        url, label = endpoint(meta["name"], meta["namespace"], spec), generation_hash(spec, config)
    stamp = now()
    scaling = scaling_status(spec, obs, old, stamp, decision)
    found = (model.status, model.condition) if model is not None else None
    return compute_status(spec, obs, old, stamp, generation, url, label, scaling, found)


@dataclass
class Acted:
    """What the first half of a pass did: the spec read, the planner's changes, and the apply."""

    spec: InferenceServiceSpec | None
    spec_error: str | None
    changes: list[ScaleChange]
    applies: bool
    result: apply.ApplyResult
    secret: dict | None
    model: model_check.ModelFinding | None

    @property
    def unchanged(self) -> bool:
        """Nothing was created or changed: what was observed before the pass still holds."""
        return not self.changes and not (self.result.created or self.result.updated or self.result.error)


def act(api: client.ApiClient, body: dict, config: OperatorConfig, work: Work, memory: Memory,
        decision: Decision | None = None, obs: Observation | None = None) -> Acted:
    """A pass's first half, on `body` (just read): the planner's `decision` (made from `obs`) acted on,
    the children applied when `work.apply` asks or the decision changes replicas."""
    spec, spec_error = parse_spec(body)
    old = body.get("status") or {}
    changes = scale_changes(spec, old, decision) if spec is not None and decision is not None else []
    _mark_removals(api, body["metadata"]["namespace"], obs, changes, config)
    applies = work.apply or bool(changes)
    known = obs.workloads if obs is not None else {}
    result, secret, model = _apply_phase(api, body, spec, spec_error, config, work, changes, applies, memory, known)
    return Acted(spec, spec_error, changes, applies, result, secret, model)


def conclude(api: client.ApiClient, body: dict, config: OperatorConfig, memory: Memory, acted: Acted,
             obs: Observation, decision: Decision | None = None, kv_probes: list[KVProbe] | None = None,
             parity: list[RouterParity] | None = None) -> None:
    """A pass's second half: status from `obs` (the children as they are after `acted`), written once
    if it changed; the events. `kv_probes` are the workers' KV health answers (None: not probed)."""
    meta, old, spec, result = body["metadata"], body.get("status") or {}, acted.spec, acted.result
    model = acted.model
    if model is not None and model_check.downloads(model):  # how the pinned commit's download Job fares
        job, job_pods = observe_download(api, meta["namespace"], download_job_name(meta["name"], model.spec.model))
        model = model_check.with_download(model, meta["name"], job, job_pods)
    elif model is not None:  # a hostPath or emptyDir cache: each worker pod downloads for itself
        roles = [obs.roles[r] for r in WORKER_ROLES if r in obs.roles]
        model = model_check.with_pod_downloads(model, [p for r in roles for p in r.pods + r.followers])
    ready = _condition(old, "Ready")
    if result.error and ready.get("message") != result.error:
        # Once per distinct failure, not per pass.
        apply.post_event(api, body, "Warning", "InvalidSpec" if spec is None else result.reason, result.error)
    if acted.applies or spec is None:
        # observedGeneration advances only once the spec it describes is applied.
        applied = not result.error and not (model is not None and model.blocking)
        generation = meta.get("generation") if applied else None
        apply_error, apply_reason = (None if spec is None else result.error), result.reason
    else:  # nothing applied: what the last apply found still holds
        failed = ready.get("reason") in ("ApplyFailed", REFUSED, policy.DENIED)
        generation, apply_error, apply_reason = None, ready["message"] if failed else None, ready.get("reason")
    status = _status(body, spec, config, generation, obs, decision, model=model, apply_error=apply_error,
                     apply_reason=apply_reason or "ApplyFailed", spec_error=acted.spec_error, kv_probes=kv_probes,
                     parity=parity)
    if acted.secret:
        status["internalSecret"] = acted.secret
    _warning_events(api, body, status, memory)
    if not same_status(old, status):
        apply.write_status(api, meta["namespace"], meta["name"], status, old)
    body["status"] = status
    for c in acted.changes:
        log.info("%s/%s: %s", meta["namespace"], meta["name"], c.message)
        apply.post_event(api, body, "Normal", c.reason, c.message)


def _apply_phase(api: client.ApiClient, body: dict, spec: InferenceServiceSpec | None, spec_error: str | None,
                 config: OperatorConfig, work: Work, changes: list[ScaleChange], applies: bool, memory: Memory,
                 known: dict[str, dict]) -> tuple[apply.ApplyResult, dict | None, model_check.ModelFinding | None]:
    """(what applying did, status.internalSecret, the model's finding). A pass that does not apply
    carries the model's finding from status (no hub call); a spec the operator's policy refuses
    (tandem.operator.policy) and a model that cannot be served apply nothing: no pod downloads a
    model it cannot serve."""
    old = body.get("status") or {}
    if spec is None:
        return apply.ApplyResult(error=spec_error), old.get("internalSecret"), None
    if not applies:
        return apply.ApplyResult(), old.get("internalSecret"), model_check.carried(body, spec)
    namespace = body["metadata"]["namespace"]
    violations = policy.judge(spec, namespace, config.policy, config.own_images)
    if violations:
        return apply.ApplyResult(error=policy.refusal(violations), reason=policy.DENIED), old.get("internalSecret"), None
    model = model_check.check(api, body, spec, config)
    if model.blocking:
        _model_event(api, body, model)
        return apply.ApplyResult(), old.get("internalSecret"), model
    replicas = render_replicas(spec, planned_status(old, changes))
    scaled = {names(body["metadata"]["name"])[c.role] for c in changes}
    result, secret = _apply(api, body, model.spec, config.for_namespace(namespace), work, replicas, scaled, memory,
                            known)
    return result, secret, model


def _model_event(api: client.ApiClient, body: dict, model: model_check.ModelFinding) -> None:
    """A Warning when the model cannot be served, once per distinct message (not per pass)."""
    old = _condition(body.get("status"), model_check.TYPE)
    if old.get("message") != model.condition["message"] and model.condition["reason"] not in WARNINGS[model_check.TYPE]:
        apply.post_event(api, body, "Warning", model.condition["reason"], model.condition["message"])


def _mark_removals(api: client.ApiClient, namespace: str, obs: Observation | None, changes: list[ScaleChange],
                   config: OperatorConfig) -> None:
    """Before replicas drop, the pods the planner chose are marked so the ReplicaSet removes those
    (with --mark-pods-for-removal; otherwise the ReplicaSet picks). Groups (a LeaderWorkerSet) go by
    index, highest first, whatever the planner preferred: pod-deletion-cost does not apply to them.
    Either way the running streams of a removed decode pod move when the kubelet's SIGTERM reaches
    it: its worker hands its sequences (their KV leased) to other decode workers through the router."""
    for i, c in enumerate(changes):
        role = obs.roles.get(c.role) if obs is not None else None
        if c.remove and role is not None and role.group_size > 1:
            going = removed_by_scale_down(role.pods, c.desired)
            changes[i] = dataclasses.replace(c, remove=going, message=f"{c.message}; removing {', '.join(going)}")
        elif c.remove and not config.mark_pods:
            changes[i] = dataclasses.replace(c, message=(
                f"{c.message}; the planner would remove {', '.join(c.remove)}, the ReplicaSet picks "
                "(marking pods is off: --mark-pods-for-removal)"))
        elif c.remove:
            problems = apply.mark_for_removal(api, namespace, role.pods if role else [], c.remove, now())
            message = f"{c.message}; removing {', '.join(c.remove)}"
            if problems:
                message += f" (could not mark {'; '.join(problems)}: the ReplicaSet picks instead)"
            changes[i] = dataclasses.replace(c, message=message)


def _apply(api: client.ApiClient, body: dict, spec: InferenceServiceSpec, config: OperatorConfig, work: Work,
           replicas: dict[str, int | None], scaled: set[str], memory: Memory,
           known: dict[str, dict]) -> tuple[apply.ApplyResult, dict | None]:
    """Renders and applies every child, the internal Secret first; posts Created/Updated/DriftCorrected
    events (not for the Deployments in `scaled`: the planner's ScaledUp/ScaledDown events say why those
    changed). Returns what happened and status.internalSecret."""
    meta, old = body["metadata"], body.get("status") or {}
    t0 = time.monotonic()
    secret = internal_secret(meta)
    result, uid = apply.ensure_internal_secret(api, secret)
    record, refused = secret_record(secret["metadata"]["name"], uid, old)
    if refused is not None:
        result = apply.ApplyResult(error=refused.message, retryable=refused.retryable, reason=REFUSED)
    if not result.error:  # the Secret exists before any pod that mounts it
        manifests = render(meta, spec, config, replicas, (record or {}).get("uid"))
        applied = children.apply_all(api, manifests, memory.applied, known)
        result = dataclasses.replace(applied, created=result.created + applied.created)
    if not result.error:  # a role that changed kind (Deployment <-> LeaderWorkerSet): the old one goes
        result = _prune(api, meta, spec, result, memory)
    if result.created or result.updated or result.error:
        log.info("applied %s/%s in %.2fs: %d created, %d updated%s", meta["namespace"], meta["name"],
                 time.monotonic() - t0, len(result.created), len(result.updated),
                 f"; failed: {result.error}" if result.error else "")
    # A periodic pass that applies a spec for the first time is not correcting drift.
    drift = work.drift and old.get("observedGeneration") == meta.get("generation")
    updated = [ref for ref in result.updated if ref.removeprefix("Deployment/") not in scaled]
    if result.created:
        apply.post_event(api, body, "Normal", "DriftCorrected" if drift else "Created",
                         "created " + ", ".join(result.created))
    if updated:
        apply.post_event(api, body, "Normal", "DriftCorrected" if drift else "Updated",
                         "updated " + ", ".join(updated))
    return result, record


def _prune(api: client.ApiClient, meta: dict, spec: InferenceServiceSpec, result: apply.ApplyResult,
           memory: Memory) -> apply.ApplyResult:
    """Deletes a role's workload of the kind it no longer uses: once per change of kinds (and once
    after the operator starts), not every pass."""
    stale = stale_workloads(meta, spec)
    kinds = tuple(apply.ref(stub) for stub in stale)
    if memory.pruned == kinds:
        return result
    try:
        deleted = apply.prune(api, meta["uid"], stale)
    except Exception as e:  # the API server failing: the next pass prunes
        log.warning("pruning the old workloads of %s/%s failed: %s", meta["namespace"], meta["name"], e)
        return result
    memory.pruned = kinds
    return dataclasses.replace(result, updated=result.updated + [f"{r} (deleted)" for r in deleted])
