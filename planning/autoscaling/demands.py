"""What each role's load asks for: demands from a snapshot, and what the planner learns from it.

Prefill: how busy the prefill pods are against targetUtilization, plus the prompt backlog and the
prompts the router had to prefill on decode (all in replica-equivalents of prefill work), and TTFT
against its target when prefill did the work. Decode: concurrency over the sequences a pod holds
within the ITL target (learned, see learn_decode_seats), KV usage and queued sequences. A latency
within `tolerance` of its target asks for no change.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from tandem.operator.spec.autoscaling import AutoscalingSpec, RoleScaling
from tandem.planning.autoscaling.snapshot import RoleWindow, Snapshot

MIN_TTFT_SAMPLES = 10  # fewer first tokens in a window: its percentile is noise, not a signal
MIN_ITL_SAMPLES = 50
BUSY_FOR_TTFT = 0.5  # prefill pods at least this busy: a high TTFT is queueing, which pods fix
KV_HIGH = 0.9  # decode KV usage above this asks for more pods, sized to bring it to KV_TARGET
KV_TARGET = 0.8
# A window over a latency target moves a role by at most this factor (decode: unless the histogram
# proves more). A percentile is interpolated within its bucket and only the bucket's lower edge is
# certain, and the router's buckets are coarse (a 3 s TTFT target sits inside (2 s, 5 s]).
LATENCY_STEP = 1.25
SEATS_CUT = LATENCY_STEP  # so the learned seats per decode pod drop by at most 1/1.25 a window
SEATS_PROBE = 1.1  # a window well under it, at nearly those seats, raises them by 10%
FALLBACK_ROUTES = ("no_prefill_worker", "prefill_saturated", "prefill_failed", "no_matching_kv_compat")


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


def _grew_in_window(rw: RoleWindow) -> bool:
    """Pods that came up within the window: its latencies are from before they served."""
    return rw.readable > rw.rated


def learn_mu(known: float | None, pre: RoleWindow | None) -> float | None:
    """Prompt tokens a prefill pod processes per busy second (its step counters), when it worked."""
    if pre is not None and pre.busy > 0.05 and pre.step_tokens_rate > 0:
        return pre.step_tokens_rate / pre.busy
    return known


def prefill_demands(snap: Snapshot, spec: AutoscalingSpec, rs: RoleScaling, mu: float | None) -> list[Demand]:
    """What the prompt load asks of the prefill pool (see the module docstring)."""
    pre, dec, router = snap.roles["prefill"], snap.roles.get("decode"), snap.router
    # Rates come from pods read at both ends of the window. A pod that could not be read is taken
    # to do what the read ones do; one that came up within the window took little of its work.
    busy = _scaled(pre, pre.busy)
    arriving = _scaled(pre, pre.prompt_tokens_rate)
    # Busy time saturates at one per pod; prompts added to the engines keep counting when they
    # outrun the pool, so arriving work over the measured speed sizes an overload.
    load = max(busy, arriving / mu) if mu else busy
    backlog = pre.outstanding_prompt_tokens or 0.0
    backlog_s = backlog / mu if mu else 0.0
    fallback_tokens = 0.0
    if router is not None and dec is not None:
        fallback = sum(router.route_rates.get(r, 0.0) for r in FALLBACK_ROUTES)
        local = max(0.0, dec.prompt_tokens_rate - pre.prompt_tokens_rate)
        routed_local = fallback + router.route_rates.get("short_prompt", 0.0)
        fallback_tokens = local * fallback / routed_local if routed_local > 0 else 0.0
    out: list[Demand] = []
    work = load + backlog_s / spec.ttft.seconds + (fallback_tokens / mu if mu else 0.0)
    if work > 0:
        reason = Reason.PROMPT_BACKLOG if backlog_s / spec.ttft.seconds > load else Reason.PREFILL_BUSY
        out.append(Demand(work / rs.target_utilization, reason,
                          f"prompts arrive at {arriving:.0f} tokens/s, {load:.2f} pods of prefill work"
                          f"{f' at {mu:.0f} tokens/s a pod' if mu else ''}, {busy:.2f} busy, "
                          f"{backlog:.0f} tokens queued"
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
    per_pod_busy = pre.busy / pre.rated if pre.rated else 0.0
    if ratio > 1 + spec.tolerance and per_pod_busy < BUSY_FOR_TTFT and backlog <= 0:
        out.append(Demand(pre.ready, Reason.TARGET_UNREACHABLE,
                          f"{words}, but prefill pods are only {per_pod_busy:.0%} busy: the prompts themselves "
                          f"take that long, more pods would not help"))
        return out
    # Under overload a queue makes TTFT grow without bound, so how far it is over says nothing of
    # the capacity missing (arriving work does, above): it only moves prefill a step at a time, and
    # not while pods that came up within the window have yet to show in it (no wind-up).
    scale = 1.0 if _in_band(ratio, spec.tolerance) else min(ratio, LATENCY_STEP)
    if scale > 1 and _grew_in_window(pre):
        scale = 1.0
        words += f"; {pre.readable - pre.rated} new prefill pods are not in this window yet"
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
