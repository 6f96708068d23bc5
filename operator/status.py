"""Observed children -> the InferenceService's status. Pure: the caller passes the clock.

Conditions (type, status, CamelCase reason, message, lastTransitionTime, observedGeneration):
  PrefillReady, DecodeReady, RouterReady  from each Deployment and its pods; a pod the scheduler
                                          cannot place surfaces as reason Unschedulable with the
                                          scheduler's own message
  KVTransferReady                         Unknown (reason NotProbed): the operator does not probe
                                          the workers' /internal/kv/health; the workers report
                                          transfer health on their own endpoints and metrics
  Ready                                   True when the three roles are; otherwise the most
                                          actionable failing reason (Unschedulable first)
lastTransitionTime changes only when a condition's status changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ROLES = ("prefill", "decode", "router")
CONDITION_FOR = {"prefill": "PrefillReady", "decode": "DecodeReady", "router": "RouterReady"}


@dataclass
class RoleObservation:
    """What the API server says about one role's Deployment and its pods."""

    exists: bool = False
    replicas: int = 0  # the Deployment's spec.replicas as applied
    ready: int = 0  # status.readyReplicas
    pods: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Observation:
    roles: dict[str, RoleObservation] = field(default_factory=dict)
    router_service: bool = False
    apply_error: str | None = None  # why the last apply failed, if it did


def condition(type_: str, status: str, reason: str, message: str) -> dict[str, str]:
    return {"type": type_, "status": status, "reason": reason, "message": message}


def _pod_problem(pods: list[dict[str, Any]]) -> tuple[str, str] | None:
    """The most telling reason a role's pods are not ready: unschedulable first, then containers."""
    for pod in pods:
        for cond in (pod.get("status") or {}).get("conditions") or []:
            if (
                cond.get("type") == "PodScheduled"
                and cond.get("status") == "False"
                and cond.get("reason") == "Unschedulable"
            ):
                name = pod["metadata"]["name"]
                return "Unschedulable", f"pod {name} cannot be scheduled: {cond.get('message', '')}"
    for pod in pods:
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in (
                "CrashLoopBackOff",
                "ImagePullBackOff",
                "ErrImagePull",
                "CreateContainerConfigError",
                "InvalidImageName",
            ):
                name = pod["metadata"]["name"]
                msg = waiting.get("message") or waiting["reason"]
                return waiting["reason"], f"pod {name}: {msg}"
    return None


def role_condition(role: str, obs: RoleObservation, desired: int) -> dict[str, str]:
    """One role's readiness condition from its Deployment and pods."""
    type_ = CONDITION_FOR[role]
    if not obs.exists:
        return condition(type_, "False", "DeploymentMissing", f"the {role} Deployment does not exist yet")
    if desired == 0:
        return condition(type_, "False", "ScaledToZero", f"{role}.replicas is 0")
    if obs.ready >= desired:
        return condition(type_, "True", "AllReplicasReady", f"{obs.ready}/{desired} {role} pods ready")
    problem = _pod_problem(obs.pods)
    if obs.ready > 0:
        msg = f"{obs.ready}/{desired} {role} pods ready"
        if problem:
            msg += f"; {problem[1]}"
        return condition(type_, "True", "MinimumReplicasReady", msg)
    if problem:
        return condition(type_, "False", problem[0], problem[1])
    return condition(type_, "False", "PodsNotReady", f"0/{desired} {role} pods ready (starting or loading the model)")


# Ready's reason when several roles fail: the first of these that applies; others in between.
URGENCY = ("Unschedulable", "ImagePullBackOff", "ErrImagePull", "InvalidImageName",
           "CreateContainerConfigError", "CrashLoopBackOff")
LEAST_URGENT = ("DeploymentMissing", "PodsNotReady", "ScaledToZero")


def _urgency(reason: str) -> int:
    if reason in URGENCY:
        return URGENCY.index(reason)
    if reason in LEAST_URGENT:
        return 100 + LEAST_URGENT.index(reason)
    return 50


def desired_replicas(spec: dict) -> dict[str, int]:
    return {role: int(spec[role]["replicas"]) for role in ROLES}


def compute_conditions(spec: dict, obs: Observation) -> list[dict[str, str]]:
    """All conditions, without timestamps: Ready first, then per role, then KVTransferReady."""
    desired = desired_replicas(spec)
    roles = [role_condition(r, obs.roles.get(r, RoleObservation()), desired[r]) for r in ROLES]
    if obs.apply_error:
        ready = condition("Ready", "False", "ApplyFailed", obs.apply_error)
    else:
        failing = [c for c in roles if c["status"] != "True"]
        if not failing:
            ready = condition("Ready", "True", "AllComponentsReady", "prefill, decode and router are ready")
        else:
            # The reason a person can act on wins (a pod that cannot be placed over one starting).
            reason = min((c["reason"] for c in failing), key=_urgency)
            ready = condition("Ready", "False", reason, "; ".join(c["message"] for c in failing))
    kv = condition(
        "KVTransferReady",
        "Unknown",
        "NotProbed",
        "the operator does not probe KV transfer; see the workers' /internal/kv/health",
    )
    return [ready, *roles, kv]


def stamp(
    new: list[dict[str, str]], old: list[dict[str, Any]] | None, now: str, generation: int | None
) -> list[dict[str, Any]]:
    """Adds lastTransitionTime (kept from the old condition when its status is unchanged)."""
    previous = {c.get("type"): c for c in old or []}
    out = []
    for cond in new:
        prev = previous.get(cond["type"])
        if prev and prev.get("status") == cond["status"] and prev.get("lastTransitionTime"):
            ltt = prev["lastTransitionTime"]
        else:
            ltt = now
        stamped: dict[str, Any] = dict(cond, lastTransitionTime=ltt)
        if generation is not None:
            stamped["observedGeneration"] = generation
        out.append(stamped)
    return out


def compute_status(
    spec: dict,
    obs: Observation,
    old_status: dict | None,
    now: str,
    observed_generation: int | None,
    endpoint: str,
    generation_label: str,
) -> dict[str, Any]:
    """The whole status object to write; equal to old_status when nothing changed."""
    old_status = old_status or {}
    desired = desired_replicas(spec)
    conditions = stamp(compute_conditions(spec, obs), old_status.get("conditions"), now, observed_generation)
    status: dict[str, Any] = {"conditions": conditions}
    if observed_generation is not None:
        status["observedGeneration"] = observed_generation
    for role in ROLES:
        ro = obs.roles.get(role, RoleObservation())
        status[role] = {
            "replicas": desired[role],
            "readyReplicas": ro.ready,
            "summary": f"{ro.ready}/{desired[role]}",
        }
    if obs.router_service:
        status["endpoint"] = endpoint
    status["generation"] = generation_label
    return status


def same_status(a: dict | None, b: dict | None) -> bool:
    """True when writing b over a would change nothing a reader cares about."""
    return (a or {}) == (b or {})
