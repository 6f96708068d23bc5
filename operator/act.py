"""A pass's first half (`act`): the planner's decision acted on, the spec judged by the operator's
policy, the model checked, the children rendered and applied, a role's old workload kind pruned, and
the Created/Updated/DriftCorrected events. Runs in a thread, called by tandem.operator.reconcile.

What the watch has seen (tandem.operator.watch) stands in for reading the children; when nothing
watched changed since a pass found every child as rendered (`Memory.settled`), the children are not
rendered again, and only the internal Secret, which the operator never reads and so cannot watch, is
created if absent: on such a settled pass once every SECRET_CHECK_RESYNCS resyncs (its POST was the
idle pass's only API call and most of its CPU), on every other pass always. A deleted Secret harms
no running pod (it read the value at start); a pod that starts changes what the watch has seen, so
its pass checks the Secret before anything else.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

from kubernetes import client
from tandem.operator import api_client, children, model_check, policy
from tandem.operator.autoscaling.status import (
    ScaleChange,
    planned_status,
    render_replicas,
    scale_changes,
)
from tandem.operator.conclude import WARNINGS, condition_of, now, parse_spec
from tandem.operator.config import OperatorConfig
from tandem.operator.group_pods import removed_by_scale_down
from tandem.operator.memory import Memory
from tandem.operator.ownership import REFUSED, secret_record
from tandem.operator.render import internal_secret, names, render, stale_workloads
from tandem.operator.spec import InferenceServiceSpec
from tandem.operator.status import Observation
from tandem.operator.watch import Seen
from tandem.operator.work import Work
from tandem.planning.autoscaling.planner import Decision

log = logging.getLogger(__name__)
SECRET_CHECK_RESYNCS = 10  # a settled pass makes sure the internal Secret exists this often (in resyncs)


@dataclass
class Acted:
    """What the first half of a pass did: the spec read, the planner's changes, and the apply."""

    spec: InferenceServiceSpec | None
    spec_error: str | None
    changes: list[ScaleChange]
    applies: bool
    result: api_client.ApplyResult
    secret: dict | None
    model: model_check.ModelFinding | None

    @property
    def unchanged(self) -> bool:
        """Nothing was created or changed: what was observed before the pass still holds."""
        return not self.changes and not (self.result.created or self.result.updated or self.result.error)


@dataclass(frozen=True)
class _Apply:
    """One pass's apply: what to render with, and what the watch has seen."""

    body: dict
    spec: InferenceServiceSpec
    config: OperatorConfig
    work: Work
    replicas: dict[str, int | None]
    scaled: set[str]  # Deployments whose change the planner's events report
    seen: Seen
    settled: bool  # nothing watched changed since a pass found every child as rendered


def act(api: client.ApiClient, body: dict, config: OperatorConfig, work: Work, memory: Memory,
        decision: Decision | None = None, obs: Observation | None = None, seen: Seen | None = None) -> Acted:
    """A pass's first half, on `body` (just read): the planner's `decision` (made from `obs`) acted on,
    the children applied when `work.apply` asks or the decision changes replicas."""
    spec, spec_error = parse_spec(body, memory)
    old = body.get("status") or {}
    changes = scale_changes(spec, old, decision) if spec is not None and decision is not None else []
    _mark_removals(api, body["metadata"]["namespace"], obs, changes, config)
    applies = work.apply or bool(changes)
    result, secret, model = _apply_phase(api, body, spec, spec_error, config, work, changes, applies, memory,
                                         seen or Seen())
    return Acted(spec, spec_error, changes, applies, result, secret, model)


def _apply_phase(api: client.ApiClient, body: dict, spec: InferenceServiceSpec | None, spec_error: str | None,
                 config: OperatorConfig, work: Work, changes: list[ScaleChange], applies: bool, memory: Memory,
                 seen: Seen) -> tuple[api_client.ApplyResult, dict | None, model_check.ModelFinding | None]:
    """(what applying did, status.internalSecret, the model's finding). A pass that does not apply
    carries the model's finding from status (no hub call); a spec the operator's policy refuses
    (tandem.operator.policy) and a model that cannot be served apply nothing: no pod downloads a
    model it cannot serve."""
    old = body.get("status") or {}
    if spec is None:
        return api_client.ApplyResult(error=spec_error), old.get("internalSecret"), None
    if not applies:
        return api_client.ApplyResult(), old.get("internalSecret"), model_check.carried(body, spec)
    fingerprint = (body["metadata"].get("resourceVersion"), seen.fingerprint())
    settled, memory.settled = not changes and memory.settled == fingerprint, None
    namespace = body["metadata"]["namespace"]
    violations = policy.judge(spec, namespace, config.policy, config.own_images)
    if violations:
        return (api_client.ApplyResult(error=policy.refusal(violations), reason=policy.DENIED),
                old.get("internalSecret"), None)
    model = model_check.check(api, body, spec, config)
    if model.blocking:
        _model_event(api, body, model)
        return api_client.ApplyResult(), old.get("internalSecret"), model
    replicas = render_replicas(spec, planned_status(old, changes))
    scaled = {names(body["metadata"]["name"])[c.role] for c in changes}
    plan = _Apply(body, model.spec, config.for_namespace(namespace), work, replicas, scaled, seen, settled)
    result, secret = _apply(api, plan, memory)
    if not (result.created or result.updated or result.error) and spec.model.pvc is None:
        memory.settled = fingerprint  # (a model.pvc claim is read every apply: it is not watched)
    return result, secret, model


def secret_due(memory: Memory, resync_seconds: float, now_s: float) -> bool:
    """Whether a settled pass makes sure the internal Secret exists: the first time, and then once
    every SECRET_CHECK_RESYNCS resyncs."""
    last = memory.secret_checked
    return last is None or now_s - last >= SECRET_CHECK_RESYNCS * resync_seconds


def _model_event(api: client.ApiClient, body: dict, model: model_check.ModelFinding) -> None:
    """A Warning when the model cannot be served, once per distinct message (not per pass)."""
    old = condition_of(body.get("status"), model_check.TYPE)
    if old.get("message") != model.condition["message"] and model.condition["reason"] not in WARNINGS[model_check.TYPE]:
        api_client.post_event(api, body, "Warning", model.condition["reason"], model.condition["message"])


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
            problems = api_client.mark_for_removal(api, namespace, role.pods if role else [], c.remove, now())
            message = f"{c.message}; removing {', '.join(c.remove)}"
            if problems:
                message += f" (could not mark {'; '.join(problems)}: the ReplicaSet picks instead)"
            changes[i] = dataclasses.replace(c, message=message)


def _apply(api: client.ApiClient, plan: _Apply, memory: Memory) -> tuple[api_client.ApplyResult, dict | None]:
    """Renders and applies every child, the internal Secret first; posts Created/Updated/DriftCorrected
    events (not for the Deployments in `plan.scaled`: the planner's ScaledUp/ScaledDown events say why
    those changed). Returns what happened and status.internalSecret."""
    meta, old = plan.body["metadata"], plan.body.get("status") or {}
    t0 = time.monotonic()
    secret = internal_secret(meta)
    if plan.settled and not secret_due(memory, plan.config.resync_seconds, t0):
        return api_client.ApplyResult(), old.get("internalSecret") or memory.secret  # as the last check found it
    result, uid = api_client.ensure_internal_secret(api, secret)
    memory.secret_checked = t0
    record, refused = secret_record(secret["metadata"]["name"], uid, old)
    if uid is not None:
        memory.secret = record
    elif refused is not None and (memory.secret or {}).get("name") == secret["metadata"]["name"]:
        record, refused = memory.secret, None  # this process created it; status did not say so yet
    if refused is not None:
        result = api_client.ApplyResult(error=refused.message, retryable=refused.retryable, reason=REFUSED)
    if plan.settled and not result.error and uid is None:
        return result, record  # the Secret was there, and nothing watched changed
    if not result.error:  # the Secret exists before any pod that mounts it
        manifests = render(meta, plan.spec, plan.config, plan.replicas, (record or {}).get("uid"))
        applied = children.apply_all(api, manifests, memory.applied, plan.seen.applied())
        result = dataclasses.replace(applied, created=result.created + applied.created)
    if not result.error:  # a role that changed kind (Deployment <-> LeaderWorkerSet): the old one goes
        result = _prune(api, meta, plan, result, memory)
    if result.created or result.updated or result.error:
        log.info("applied %s/%s in %.2fs: %d created, %d updated%s", meta["namespace"], meta["name"],
                 time.monotonic() - t0, len(result.created), len(result.updated),
                 f"; failed: {result.error}" if result.error else "")
    # A periodic pass that applies a spec for the first time is not correcting drift.
    drift = plan.work.drift and old.get("observedGeneration") == meta.get("generation")
    updated = [ref for ref in result.updated if ref.removeprefix("Deployment/") not in plan.scaled]
    if result.created:
        api_client.post_event(api, plan.body, "Normal", "DriftCorrected" if drift else "Created",
                              "created " + ", ".join(result.created))
    if updated:
        api_client.post_event(api, plan.body, "Normal", "DriftCorrected" if drift else "Updated",
                              "updated " + ", ".join(updated))
    return result, record


def _prune(api: client.ApiClient, meta: dict, plan: _Apply, result: api_client.ApplyResult,
           memory: Memory) -> api_client.ApplyResult:
    """Deletes a role's workload of the kind it no longer uses: once per change of kinds (and once
    after the operator starts), not every pass."""
    stale = stale_workloads(meta, plan.spec)
    kinds = tuple(api_client.ref(stub) for stub in stale)
    if memory.pruned == kinds:
        return result
    try:
        deleted = api_client.prune(api, meta["uid"], stale, plan.seen.applied())
    except Exception as e:  # the API server failing: the next pass prunes
        log.warning("pruning the old workloads of %s/%s failed: %s", meta["namespace"], meta["name"], e)
        return result
    memory.pruned = kinds
    return dataclasses.replace(result, updated=result.updated + [f"{r} (deleted)" for r in deleted], pruned=deleted)
