"""spec.autoscaling in status, both ways, and the changes a decision makes to it. Pure.

What the planner decides for a role it owns is kept in the InferenceService's status (the role's
`replicas`, with a reason and a message), so it survives an operator restart and reconcile stays
level-triggered: the renderer reads each autoscaled role's replicas back from there
(`render_replicas`). In External mode the renderer leaves `replicas` out (an HPA or KEDA owns it)
and status reports what the Deployment asks for.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tandem.operator.spec import WORKER_ROLES, InferenceServiceSpec, Mode
from tandem.operator.status import Observation, ScaledRole, Scaling, condition
from tandem.planning.autoscaling.planner import (
    CONDITION_TYPE,
    Decision,
    Reason,
    RoleDecision,
    condition_of,
)

OPERATOR, EXTERNAL = Mode.OPERATOR.value, Mode.EXTERNAL.value
MAX_MESSAGE = 4096  # the CRD's bound on status.<role>.message


def _role_status(old_status: Mapping[str, Any] | None, role: str) -> dict[str, Any]:
    return dict((old_status or {}).get(role) or {})


def kept_replicas(spec: InferenceServiceSpec, old_status: Mapping[str, Any] | None, role: str) -> int:
    """The desired pods of a role the planner owns: its last decision, kept in status (at first, the
    role's spec.<role>.replicas), within minReplicas and maxReplicas."""
    rs = spec.autoscaling.roles[role]  # type: ignore[union-attr]
    kept = _role_status(old_status, role).get("replicas")
    if not isinstance(kept, int) or isinstance(kept, bool):
        kept = spec.role(role).replicas
    return rs.clamp(kept)


def render_replicas(spec: InferenceServiceSpec, old_status: Mapping[str, Any] | None) -> dict[str, int | None]:
    """Each worker role's Deployment replicas: the spec's; the planner's (from status) for a role it
    owns; None (the field left to an HPA or KEDA) for a role in External mode."""
    out: dict[str, int | None] = {role: spec.role(role).replicas for role in WORKER_ROLES}
    a = spec.autoscaling
    for role in a.roles if a is not None else ():
        out[role] = None if a.external(role) else kept_replicas(spec, old_status, role)  # type: ignore[union-attr]
    return out


def _external(spec: InferenceServiceSpec, obs: Observation, role: str) -> ScaledRole:
    ro = obs.roles.get(role)
    n = ro.replicas if ro is not None and ro.exists else spec.role(role).replicas
    return ScaledRole(n, EXTERNAL, Reason.EXTERNAL.value,
                      f"an external autoscaler (HPA or KEDA) owns {role} replicas; the Deployment asks for {n}")


def scaling_status(spec: InferenceServiceSpec | None, obs: Observation, old_status: Mapping[str, Any] | None,
                   now: str, decision: Decision | None = None) -> Scaling | None:
    """Status of the autoscaled roles: `decision` (the planner's, just made) when given, else what
    status already says (a reconcile between two decisions changes none of it)."""
    a = spec.autoscaling if spec is not None else None
    if a is None:
        return None
    roles: dict[str, ScaledRole] = {}
    for role, rs in a.roles.items():
        if rs.mode is Mode.EXTERNAL:
            roles[role] = _external(spec, obs, role)  # type: ignore[arg-type]
            continue
        old, kept = _role_status(old_status, role), kept_replicas(spec, old_status, role)  # type: ignore[arg-type]
        d = decision.roles.get(role) if decision is not None else None
        if d is not None and d.owned:
            when = now if d.desired != kept else old.get("lastScaleTime")
            roles[role] = ScaledRole(d.desired, OPERATOR, d.reason.value, d.message[:MAX_MESSAGE], when)
        elif old.get("mode") == OPERATOR and old.get("reason"):
            roles[role] = ScaledRole(kept, OPERATOR, old["reason"], old.get("message", ""), old.get("lastScaleTime"))
        else:
            roles[role] = ScaledRole(kept, OPERATOR, Reason.COLLECTING.value,
                                     f"holding {kept} {role} replicas until the planner has read the metrics twice")
    return Scaling(roles, _condition(roles, old_status, decision))


def _condition(roles: Mapping[str, ScaledRole], old_status: Mapping[str, Any] | None,
               decision: Decision | None) -> dict[str, str]:
    if all(sr.mode == EXTERNAL for sr in roles.values()):
        return condition_of({r: RoleDecision(r, sr.desired, sr.desired, Reason.EXTERNAL, sr.message, owned=False)
                             for r, sr in roles.items()})
    if decision is not None:
        return decision.condition
    old = next((c for c in (old_status or {}).get("conditions") or [] if c.get("type") == CONDITION_TYPE), None)
    if old is not None and old.get("reason") != "External":
        return condition(CONDITION_TYPE, old["status"], old.get("reason", ""), old.get("message", ""))
    return condition(CONDITION_TYPE, "Unknown", Reason.COLLECTING.value,
                     "the planner needs a second scrape before it can take rates")


@dataclass(frozen=True)
class ScaleChange:
    """One change of an owned role's desired replicas that a decision makes: the Event to post, and
    (going down) the pods the planner chose to remove."""

    role: str
    desired: int
    reason: str  # ScaledUp | ScaledDown
    message: str
    remove: tuple[str, ...] = ()


def scale_changes(spec: InferenceServiceSpec, old_status: Mapping[str, Any] | None,
                  decision: Decision) -> list[ScaleChange]:
    """The roles whose desired replicas `decision` changes against what status keeps."""
    a = spec.autoscaling
    changes = []
    for role, d in decision.roles.items():
        if a is None or not a.owns(role):
            continue
        kept = kept_replicas(spec, old_status, role)
        if d.desired == kept:
            continue
        message = f"{role} {d.message} [{d.reason}]" if d.current == kept else (
            f"{role} {kept} -> {d.desired} [{d.reason}]: {d.message}")
        remove = d.remove if d.desired < kept else ()
        changes.append(ScaleChange(role, d.desired, "ScaledUp" if d.desired > kept else "ScaledDown",
                                   message, remove))
    return changes


def planned_status(old_status: Mapping[str, Any] | None, changes: list[ScaleChange]) -> dict[str, Any]:
    """Status as it reads once `changes` are kept in it (what the renderer takes replicas from)."""
    out = dict(old_status or {})
    for c in changes:
        out[c.role] = {**_role_status(old_status, c.role), "replicas": c.desired}
    return out
