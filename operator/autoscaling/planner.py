"""The planner's decision: a snapshot of metrics + current replicas + spec + its state -> replicas.

Pure: time comes in as `now`, nothing is read from the clock or the network. Per role it turns
the snapshot into demands (each a replica count and the signal behind it), takes the largest,
then applies what keeps it calm, in this order (as the HPA does):

  1. demands: prefill from TTFT against its target (when prefill did the work), from how busy the
     prefill pods are against targetUtilization plus the prompt backlog and prompts the router had
     to prefill on decode; decode from ITL against its target, from KV usage and queued sequences.
     A latency within `tolerance` of its target asks for no change.
  2. min/max: the recommendation is clamped, and that is remembered (with its time) in the state.
  3. stabilisation: up to the lowest recommendation of the up window, down to the highest of the
     down window, so a short spike or dip moves nothing.
  4. rate limit: at most the larger of maxStep and maxStepPercent of the current count per decision.

When it scales down it names the pods to remove: pods that are not ready first, then the ones with
the fewest running sequences. Missing metrics hold the current size and say what is missing.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from tandem.operator.autoscaling.snapshot import PodWindow, RoleWindow, Snapshot
from tandem.operator.autoscaling.spec import AutoscalingSpec, Mode, RoleScaling
from tandem.operator.status import condition

CONDITION_TYPE = "Autoscaling"
MIN_TTFT_SAMPLES = 10  # fewer first tokens in a window: its percentile is noise, not a signal
MIN_ITL_SAMPLES = 50
BUSY_FOR_TTFT = 0.5  # prefill pods at least this busy: a high TTFT is queueing, which pods fix
KV_HIGH = 0.9  # decode KV usage above this asks for more pods, sized to bring it to KV_TARGET
KV_TARGET = 0.8
SEATS_CUT = 1.25  # a window over the ITL target lowers the learned seats per decode pod by at most 1/1.25
SEATS_PROBE = 1.1  # a window well under it, at nearly those seats, raises them by 10%
FALLBACK_ROUTES = ("no_prefill_worker", "prefill_saturated", "prefill_failed", "no_matching_generation")


class Reason(enum.StrEnum):
    """One word per role for status: why the desired replicas are what they are."""

    TTFT_ABOVE_TARGET = "TTFTAboveTarget"
    ITL_ABOVE_TARGET = "ITLAboveTarget"
    PREFILL_BUSY = "PrefillBusy"
    PROMPT_BACKLOG = "PromptBacklog"
    KV_SATURATED = "KVSaturated"
    QUEUE_BUILDING = "QueueBuilding"
    LOAD_DROPPED = "LoadDropped"
    IDLE = "Idle"
    WITHIN_TARGET = "WithinTarget"
    TARGET_UNREACHABLE = "TargetUnreachable"
    STABILIZING = "Stabilizing"
    AT_MAX = "AtMaxReplicas"
    AT_MIN = "AtMinReplicas"
    OUTSIDE_LIMITS = "OutsideLimits"
    METRICS_UNAVAILABLE = "MetricsUnavailable"
    COLLECTING = "CollectingMetrics"
    EXTERNAL = "External"


UP_REASONS = {Reason.TTFT_ABOVE_TARGET, Reason.ITL_ABOVE_TARGET, Reason.PREFILL_BUSY, Reason.PROMPT_BACKLOG,
              Reason.KV_SATURATED, Reason.QUEUE_BUILDING}


@dataclass(frozen=True)
class Demand:
    """Replicas one signal asks for, and the words that explain it."""

    replicas: float
    reason: Reason
    detail: str


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


def _fmt_s(x: float) -> str:
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2g} s"


def _latency_ratio(hist, q: float, target: float, min_samples: int):
    """(observed percentile, observed / target, surely-at-least ratio), or None when the window
    holds too few samples. The percentile is interpolated within a bucket, so only the bucket's
    lower edge is certain: the third value is that edge over the target."""
    if hist is None or hist.count < min_samples:
        return None
    observed = hist.quantile(q)
    if observed is None:
        return None
    return observed, observed / target, (hist.bucket_floor(q) or 0.0) / target


def _in_band(ratio: float, tolerance: float) -> bool:
    return abs(ratio - 1.0) <= tolerance


def _scaled(rw: RoleWindow, value: float) -> float:
    """A sum over the readable pods, extrapolated to every ready pod (some could not be read)."""
    return value * rw.ready / rw.readable if rw.readable else value


def _learn_mu(state: PlannerState, pre: RoleWindow | None) -> float | None:
    if pre is not None and pre.busy > 0.05 and pre.prompt_tokens_rate > 0:
        return pre.prompt_tokens_rate / pre.busy
    return state.prefill_tokens_per_busy_s


def prefill_demands(snap: Snapshot, spec: AutoscalingSpec, rs: RoleScaling, mu: float | None) -> list[Demand]:
    """What the prompt load asks of the prefill pool (see the module docstring)."""
    pre, dec, router = snap.roles["prefill"], snap.roles.get("decode"), snap.router
    busy = _scaled(pre, pre.busy) if pre.rated else 0.0
    backlog = pre.outstanding_prompt_tokens or 0.0
    backlog_s = backlog / mu if mu else 0.0
    fallback_tokens = 0.0
    if router is not None and dec is not None:
        fallback = sum(router.route_rates.get(r, 0.0) for r in FALLBACK_ROUTES)
        local = max(0.0, dec.prompt_tokens_rate - pre.prompt_tokens_rate)
        routed_local = fallback + router.route_rates.get("short_prompt", 0.0)
        fallback_tokens = local * fallback / routed_local if routed_local > 0 else 0.0
    out: list[Demand] = []
    work = busy + backlog_s / spec.ttft.seconds + (fallback_tokens / mu if mu else 0.0)
    if work > 0:
        reason = Reason.PROMPT_BACKLOG if backlog_s / spec.ttft.seconds > busy else Reason.PREFILL_BUSY
        out.append(Demand(work / rs.target_utilization, reason,
                          f"prefill pods {busy:.2f} replicas busy, {backlog:.0f} prompt tokens queued"
                          f"{f', {fallback_tokens:.0f} tokens/s prefilled on decode' if fallback_tokens else ''}"
                          f" (target utilization {rs.target_utilization:.0%})"))
    lat = _latency_ratio(router.ttft if router else None, spec.ttft.quantile, spec.ttft.seconds, MIN_TTFT_SAMPLES)
    if pre.ready == 0:
        out.extend(_from_zero(snap, spec, lat, work / rs.target_utilization))
        return out
    if lat is None:
        return out
    observed, ratio, _ = lat
    words = f"TTFT p{spec.ttft.percentile:g} {_fmt_s(observed)} vs target {_fmt_s(spec.ttft.seconds)}"
    if pre.prompt_tokens_rate <= 0 and backlog <= 0:
        return out  # prefill did nothing: the TTFT seen is decode-side prefill, not this pool's
    per_pod_busy = busy / pre.ready
    if ratio > 1 + spec.tolerance and per_pod_busy < BUSY_FOR_TTFT and backlog <= 0:
        out.append(Demand(pre.ready, Reason.TARGET_UNREACHABLE,
                          f"{words}, but prefill pods are only {per_pod_busy:.0%} busy: the prompts themselves "
                          f"take that long, more pods would not help"))
        return out
    scale = 1.0 if _in_band(ratio, spec.tolerance) else ratio
    out.append(Demand(pre.ready * scale, Reason.TTFT_ABOVE_TARGET if scale > 1 else Reason.WITHIN_TARGET,
                      f"{words}, prefill pods {per_pod_busy:.0%} busy"))
    return out


def _from_zero(snap: Snapshot, spec: AutoscalingSpec, ttft, work: float) -> list[Demand]:
    """With no prefill pod, decode pods prefill every prompt and their streams stall meanwhile: one
    prefill pod is wanted once that shows, in TTFT or in ITL."""
    dec, router = snap.roles.get("decode"), snap.router
    if dec is None or dec.prompt_tokens_rate <= 0:
        return []
    itl = _latency_ratio(router.itl if router else None, spec.itl.quantile, spec.itl.seconds, MIN_ITL_SAMPLES)
    for name, lat, target in (("TTFT", ttft, spec.ttft), ("ITL", itl, spec.itl)):
        if lat is not None and lat[1] > 1 + spec.tolerance:
            return [Demand(max(1.0, work), Reason.TTFT_ABOVE_TARGET if name == "TTFT" else Reason.ITL_ABOVE_TARGET,
                           f"{name} p{target.percentile:g} {_fmt_s(lat[0])} vs target {_fmt_s(target.seconds)} "
                           f"with no prefill pod: decode pods prefill every prompt, stalling their streams")]
    return []


@dataclass(frozen=True)
class Seats:
    """Sequences one decode pod holds within the ITL target, as learned so far."""

    per_pod: float
    bounded: bool = False  # a window over target has shown where the limit is (so it may scale up)


def learn_decode_seats(snap: Snapshot, spec: AutoscalingSpec, seats: Seats | None) -> Seats | None:
    """Updates the learned seats per decode pod from one window, the way TCP finds its window.

    Decode step time is flat with the batch until a pod runs out of memory bandwidth or compute,
    then climbs steeply, so ITL is no proportional measure of load: the planner sizes decode on
    concurrency, and learns the concurrency per pod that keeps ITL on target. A window over target
    lowers the estimate to the concurrency it saw divided by the overshoot (by at most 1/SEATS_CUT);
    one on target at a higher concurrency raises it to that; one well under target at nearly the
    estimate probes SEATS_PROBE higher.
    """
    dec, router = snap.roles.get("decode"), snap.router
    if dec is None or router is None or not dec.readable or dec.running <= 0:
        return seats
    lat = _latency_ratio(router.itl, spec.itl.quantile, spec.itl.seconds, MIN_ITL_SAMPLES)
    if lat is None:
        return seats
    per_pod = dec.running / dec.readable
    _, ratio, sure = lat
    if ratio > 1 + spec.tolerance:
        cut = per_pod / max(min(ratio, SEATS_CUT), sure)
        return Seats(cut if seats is None else min(seats.per_pod, cut), bounded=True)
    if seats is None:
        return Seats(per_pod * (SEATS_PROBE if ratio < 1 - spec.tolerance else 1.0))
    if ratio <= 1.0 and per_pod > seats.per_pod:
        return replace(seats, per_pod=per_pod)
    if ratio < 1 - spec.tolerance and per_pod >= 0.8 * seats.per_pod:
        return replace(seats, per_pod=seats.per_pod * SEATS_PROBE)
    return seats


def decode_demands(snap: Snapshot, spec: AutoscalingSpec, seats: Seats | None) -> list[Demand]:
    """What concurrency asks of the decode pool: sequences over learned seats, KV room, queues."""
    dec, router = snap.roles["decode"], snap.router
    n = dec.ready
    out: list[Demand] = []
    usage = dec.kv_usage
    if usage is not None and usage > 0:
        grow = usage >= KV_HIGH
        out.append(Demand(n * usage / KV_TARGET if grow else n * usage / KV_HIGH,
                          Reason.KV_SATURATED if grow else Reason.WITHIN_TARGET,
                          f"decode KV {usage:.0%} used"))
    if dec.waiting > 0 and dec.waiting > spec.tolerance * dec.running:
        out.append(Demand(n * (dec.running + dec.waiting) / max(dec.running, 1.0), Reason.QUEUE_BUILDING,
                          f"{dec.waiting:.0f} sequences wait for a decode slot, {dec.running:.0f} run"))
    concurrency = _scaled(dec, dec.running + dec.waiting)
    if concurrency <= 0:
        return out
    lat = _latency_ratio(router.itl if router else None, spec.itl.quantile, spec.itl.seconds, MIN_ITL_SAMPLES)
    words = (f"ITL p{spec.itl.percentile:g} {_fmt_s(lat[0])} vs target {_fmt_s(spec.itl.seconds)}"
             if lat else "too few tokens to judge ITL")
    if seats is None:
        out.append(Demand(n, Reason.WITHIN_TARGET, f"{concurrency:.0f} sequences run; {words}; "
                          f"no estimate yet of how many a pod holds within target"))
        return out
    above = lat is not None and lat[1] > 1 + spec.tolerance
    wanted = concurrency / seats.per_pod
    if above:
        wanted = max(wanted, n + 1.0)
    elif not seats.bounded or (lat is not None and lat[1] >= 1 - spec.tolerance):
        wanted = min(wanted, n)  # an estimate never proven too high, or ITL near target: only shrink
    if n and _in_band(wanted / n, spec.tolerance):
        wanted = n
    out.append(Demand(wanted, Reason.ITL_ABOVE_TARGET if above else Reason.WITHIN_TARGET,
                      f"{concurrency:.0f} sequences at {seats.per_pod:.1f} per pod (what a pod holds within "
                      f"the ITL target, learned); {words}"))
    return out


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


def _condition(decisions: Mapping[str, RoleDecision]) -> dict[str, str]:
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
    mu = _learn_mu(state, snapshot.roles.get("prefill"))
    seats = state.decode_seats
    if snapshot.window_s is not None and "decode" in spec.roles:
        seats = learn_decode_seats(snapshot, spec, seats)
    state = replace(state, prefill_tokens_per_busy_s=mu, decode_seats=seats)
    decisions: dict[str, RoleDecision] = {}
    for role, rs in spec.roles.items():
        decisions[role], state = _decide_role(role, snapshot, int(current.get(role, 0)), spec, rs, state, now, mu)
    return Decision(now, decisions, _condition(decisions)), state
