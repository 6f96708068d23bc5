"""The planner's decision: a snapshot of metrics + current replicas + spec + its state -> replicas.

Pure: time comes in as `now`, nothing is read from the clock or the network. Per role it turns
the snapshot into demands (each a replica count and the signal behind it, see demands.py), takes
the largest, then applies what keeps it calm, in this order (as the HPA does):

  1. demands: prefill from how busy its pods are (plus the prompt backlog and prompts prefilled on
     decode) and from TTFT; decode from concurrency over the sequences a pod holds within the ITL
     target (learned), from KV usage and queued sequences.
  2. min/max: the recommendation is clamped, and that is remembered (with its time) in the state.
  3. stabilisation: up to the lowest recommendation of the up window, down to the highest of the
     down window, so a short spike or dip moves nothing.
  4. rate limit: at most the larger of maxStep and maxStepPercent of the current count per decision.

When it scales down it names the pods to remove: pods that are not ready first, then the ones with
the fewest running sequences. Missing metrics hold the current size and say what is missing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from tandem.operator.spec.autoscaling import AutoscalingSpec, Mode, RoleScaling
from tandem.planning.autoscaling.demands import (
    UP_REASONS,
    Demand,
    Reason,
    Seats,
    decode_demands,
    learn_decode_seats,
    learn_mu,
    prefill_demands,
)
from tandem.planning.autoscaling.snapshot import PodWindow, RoleWindow, Snapshot


def condition(type_: str, status: str, reason: str, message: str) -> dict[str, str]:
    """A status condition as the operator writes it (it adds the transition time and generation)."""
    return {"type": type_, "status": status, "reason": reason, "message": message}


__all__ = ["CONDITION_TYPE", "Decision", "PlannerState", "Reason", "RoleDecision", "Seats", "choose_removals",
           "condition_of", "plan"]

CONDITION_TYPE = "Autoscaling"


@dataclass(frozen=True)
class RoleDecision:
    role: str
    current: int
    desired: int
    reason: Reason
    message: str
    recommended: int | None = None  # what the metrics asked for, clamped, before stabilisation
    remove: tuple[str, ...] = ()  # pods to delete when desired < current, in order
    limited: str | None = None  # "max" or "min" when a limit stopped the planner
    owned: bool = True  # False in External mode: the operator must not write replicas


@dataclass(frozen=True)
class Decision:
    time: float
    roles: dict[str, RoleDecision]
    condition: dict[str, str]


@dataclass(frozen=True)
class PlannerState:
    """What the planner remembers between calls: recent recommendations and what it learned."""

    history: dict[str, tuple[tuple[float, int], ...]] = field(default_factory=dict)
    prefill_tokens_per_busy_s: float | None = None  # prompt tokens one prefill pod does per busy second
    decode_seats: Seats | None = None  # sequences one decode pod holds within the ITL target


def _missing(role: str, snap: Snapshot) -> str | None:
    """Why this role cannot be judged from this snapshot, or None when it can."""
    if snap.router is None:
        return "no router could be read for TTFT and ITL"
    rw = snap.roles.get(role)
    if rw is None:
        return f"no {role} pods were scraped"
    if rw.ready and rw.readable * 2 < rw.ready:
        return f"only {rw.readable} of {rw.ready} ready {role} pods could be read"
    if role == "prefill" and "decode" in snap.roles and not snap.roles["decode"].readable:
        return "no decode pod could be read for the prompts it prefills"
    return None


def choose_removals(rw: RoleWindow, count: int) -> tuple[str, ...]:
    """The pods to remove first: not ready, then fewest sequences (running, queued, leased)."""
    def key(p: PodWindow):
        load = p.running + p.waiting + p.leased
        return (p.ready, not p.readable, load, p.outstanding_prompt_tokens or 0.0, p.name)

    return tuple(p.name for p in sorted(rw.pods, key=key)[:max(0, count)])


def _stabilize(history: tuple[tuple[float, int], ...], now: float, current: int, rs: RoleScaling) -> int:
    """The HPA's rule: up to the lowest recommendation in the up window, down to the highest."""
    up = min(r for t, r in history if t >= now - rs.scale_up.stabilization_s)
    down = max(r for t, r in history if t >= now - rs.scale_down.stabilization_s)
    out = current
    if out < up:
        out = up
    if out > down:
        out = down
    return out


def _hold(role: str, current: int, rs: RoleScaling, reason: Reason, message: str) -> RoleDecision:
    return RoleDecision(role, current, rs.clamp(current), reason, message)


def _decide_role(role: str, snap: Snapshot, current: int, spec: AutoscalingSpec, rs: RoleScaling,
                 state: PlannerState, now: float, mu: float | None) -> tuple[RoleDecision, PlannerState]:
    if rs.mode is Mode.EXTERNAL:
        return RoleDecision(role, current, current, Reason.EXTERNAL,
                            f"{role} replicas are owned by an external autoscaler (HPA or KEDA)", owned=False), state
    if rs.clamp(current) != current:
        target = rs.clamp(current)
        return RoleDecision(role, current, target, Reason.OUTSIDE_LIMITS,
                            f"{current} is outside [{rs.min_replicas}, {rs.max_replicas}]: set to {target}",
                            recommended=target), state
    if snap.window_s is None:
        return _hold(role, current, rs, Reason.COLLECTING, "waiting for a second scrape to take rates"), state
    why = _missing(role, snap)
    if why is not None:
        return _hold(role, current, rs, Reason.METRICS_UNAVAILABLE,
                     f"holding {current} {role} replicas: {why}"), state
    demands = (prefill_demands(snap, spec, rs, mu) if role == "prefill"
               else decode_demands(snap, spec, state.decode_seats))
    top = max(demands, key=lambda d: d.replicas) if demands else Demand(0.0, Reason.IDLE, f"no {role} load")
    wanted = math.ceil(top.replicas - 1e-9)
    recommended = rs.clamp(wanted)
    hist = tuple((t, r) for t, r in state.history.get(role, ())
                 if t >= now - max(rs.scale_up.stabilization_s, rs.scale_down.stabilization_s))
    hist = (*hist, (now, recommended))
    state = replace(state, history={**state.history, role: hist})
    stable = _stabilize(hist, now, current, rs)
    behavior = rs.scale_up if stable > current else rs.scale_down
    step = behavior.step_limit(current)
    desired = max(current - step, min(current + step, stable))
    return _explain(role, current, desired, wanted, recommended, stable, top, rs, snap), state


def _explain(role: str, current: int, desired: int, wanted: int, recommended: int, stable: int,
             top: Demand, rs: RoleScaling, snap: Snapshot) -> RoleDecision:
    """Reason and message for one role's decision, from the signal that set it and what held it."""
    limited = "max" if wanted > recommended else "min" if wanted < recommended else None
    tail = f"; step limited from {stable}" if desired != stable else ""
    if desired > current:
        reason = top.reason if top.reason in UP_REASONS else Reason.LOAD_DROPPED
        msg = f"{current} -> {desired}: {top.detail}{tail}"
    elif desired < current:
        reason = Reason.IDLE if top.reason is Reason.IDLE or wanted == 0 else Reason.LOAD_DROPPED
        msg = f"{current} -> {desired}: {top.detail}{tail}"
    elif recommended < current:
        reason = Reason.STABILIZING
        msg = (f"holding {current}: {top.detail} asks for {recommended}, but the last "
               f"{rs.scale_down.stabilization_s:g} s asked for more")
    elif recommended > current:
        reason = Reason.STABILIZING
        msg = f"holding {current}: {top.detail} asks for {recommended} within the scale-up window"
    elif limited == "max":
        reason, msg = Reason.AT_MAX, f"at maxReplicas {rs.max_replicas}: {top.detail} asks for {wanted}"
    elif limited == "min":
        reason, msg = Reason.AT_MIN, f"at minReplicas {rs.min_replicas}: {top.detail}"
    else:
        reason = top.reason if top.reason in (Reason.IDLE, Reason.TARGET_UNREACHABLE) else Reason.WITHIN_TARGET
        msg = f"holding {current}: {top.detail}"
    remove = choose_removals(snap.roles[role], current - desired) if desired < current else ()
    return RoleDecision(role, current, desired, reason, msg, recommended, remove, limited)


def condition_of(decisions: Mapping[str, RoleDecision]) -> dict[str, str]:
    """The Autoscaling condition: external, unable to read metrics, collecting, limited or active."""
    owned = [d for d in decisions.values() if d.owned]
    if not owned:
        return condition(CONDITION_TYPE, "False", "External",
                         "replicas of " + " and ".join(decisions) + " are owned by an external autoscaler")
    unavailable = [d for d in owned if d.reason is Reason.METRICS_UNAVAILABLE]
    if unavailable:
        return condition(CONDITION_TYPE, "False", "MetricsUnavailable",
                         "; ".join(f"{d.role}: {d.message}" for d in unavailable))
    if any(d.reason is Reason.COLLECTING for d in owned):
        return condition(CONDITION_TYPE, "Unknown", "CollectingMetrics",
                         "the planner needs a second scrape before it can take rates")
    summary = "; ".join(f"{d.role} {d.current}->{d.desired} ({d.reason})" for d in owned)
    for lim, word in (("max", "LimitedByMax"), ("min", "LimitedByMin")):
        hit = [d for d in owned if d.limited == lim]
        if hit:
            return condition(CONDITION_TYPE, "True", word,
                             "; ".join(f"{d.role}: {d.message}" for d in hit) + f" [{summary}]")
    return condition(CONDITION_TYPE, "True", "Active", summary)


def plan(snapshot: Snapshot, current: Mapping[str, int], spec: AutoscalingSpec, state: PlannerState,
         now: float) -> tuple[Decision, PlannerState]:
    """One decision for every autoscaled role, and the state to pass to the next call.

    `current` is each role's replicas as applied (spec.replicas of its Deployment); the ready pods
    come from the snapshot. Roles not in spec.roles are left alone (not in the decision).
    """
    mu = learn_mu(state.prefill_tokens_per_busy_s, snapshot.roles.get("prefill"))
    seats = state.decode_seats
    if snapshot.window_s is not None and "decode" in spec.roles:
        seats = learn_decode_seats(snapshot, spec, seats)
    state = replace(state, prefill_tokens_per_busy_s=mu, decode_seats=seats)
    decisions: dict[str, RoleDecision] = {}
    for role, rs in spec.roles.items():
        decisions[role], state = _decide_role(role, snapshot, int(current.get(role, 0)), spec, rs, state, now, mu)
    return Decision(now, decisions, condition_of(decisions)), state
