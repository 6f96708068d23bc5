"""Sizing a deployment for a workload from one worker's measured capacity (pure: no I/O, no clock).

Each layout starts where the operator's planner would hold a running service (its rules in
planning/autoscaling/demands.py): prefill workers = prompt work / targetUtilization, the work being
arriving prompt tokens over what one worker prefills per busy second; decode workers = concurrency
over the sequences one worker holds within the ITL target (the batch whose measured step fits it).
The simulator then checks that start (predict.py), and the fleet moves one worker at a time,
towards fewer while both targets hold and towards more where one is missed: the recommendation is
the smallest fleet the simulator finds within both targets. Colocated (no prefill worker; every
worker prefills in chunks beside its streams) is sized the same way for each chunk size whose step
fits the ITL target, and disaggregation is recommended when it needs fewer workers, or as many
with more margin.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from tandem.planning.capacity import Capacity
from tandem.planning.predict import Fleet, Layout, Prediction, predict
from tandem.planning.workload import Workload

TARGET_UTILIZATION = 0.8  # spec.autoscaling.prefill.targetUtilization's default: the planner's busy target
GAP_FACTOR = 2.0  # a decode worker's step with a prompt chunk: at most this many ordinary steps (issue 23)
MAX_SIMULATIONS = 40  # per layout and chunk size
CHUNK_CHOICES = 3  # colocated chunk sizes tried: the largest that fits the ITL target, its half, its quarter
STALLED = 3  # workers added in a row without the worst latency improving 1%: more workers do not help
HEADROOM = 0.1  # the simulated percentiles must come within this fraction under the targets


@dataclass(frozen=True)
class Sized:
    """One layout's smallest fleet within the targets, or why there is none."""

    layout: Layout
    fleet: Fleet | None
    prediction: Prediction | None
    problem: str | None = None  # None: the fleet meets both targets in the simulator
    simulations: int = 0


@dataclass(frozen=True)
class Plan:
    workload: Workload
    seats: int  # sequences one decode worker holds within the ITL target
    chosen: Sized
    others: tuple[Sized, ...]
    why: str


def _s(x: float) -> str:
    return f"{x * 1e3:.0f} ms" if x < 1 else f"{x:.2f} s"


def unreachable(cap: Capacity, wl: Workload) -> str | None:
    """Why no number of workers can meet the targets, or None."""
    longest = wl.prompt.quantile(wl.ttft.quantile)
    if cap.prefill_s(longest) > wl.ttft.seconds:
        return (f"a p{wl.ttft.percentile:g} prompt ({longest:.0f} tokens) alone takes {_s(cap.prefill_s(longest))} "
                f"to prefill on one worker, over the TTFT target of {_s(wl.ttft.seconds)}: more workers cannot "
                "help; a faster worker (more threads, an accelerator, tensor parallelism) or a longer target can")
    if cap.step_s(1) > wl.itl.seconds:
        return (f"one decode step of a single sequence takes {_s(cap.step_s(1))}, over the ITL target of "
                f"{_s(wl.itl.seconds)}: more workers cannot help; a faster worker or a longer target can")
    return None


def planner_sizes(cap: Capacity, wl: Workload, seats: int) -> tuple[float, float]:
    """(prefill, decode) workers as the planner's demands size them: busy prefill work over the target
    utilization; concurrency (Little's law at the step time of `seats`) over `seats`."""
    prefill_work = wl.rate * cap.prefill_s(wl.prompt.mean())
    concurrency = wl.rate * max(0.0, wl.output.mean() - 1) * cap.step_s(seats)
    return prefill_work / TARGET_UTILIZATION, concurrency / seats


def typical_batch(cap: Capacity, wl: Workload, decode_workers: int) -> int:
    """Sequences one of `decode_workers` runs on average: Little's law at its own step time."""
    n = 1.0
    for _ in range(20):
        n = max(1.0, wl.rate * max(0.0, wl.output.mean() - 1) * cap.step_s(max(1, round(n))) / decode_workers)
    return max(1, round(n))


def chunk_within(cap: Capacity, n: int, bound_s: float, block: int) -> int:
    """The largest multiple of `block` prompt tokens whose step beside n streams takes at most
    bound_s (0 when not even one block fits)."""
    spare = bound_s - (cap.step_s(n) if n > 0 else 0.0) - cap.prefill_overhead_s
    return max(0, int(spare * cap.prefill_tokens_per_s // block) * block)


def missed_words(p: Prediction, wl: Workload) -> str:
    """Which targets a prediction misses, with the figures."""
    ttft, itl = p.misses(wl)
    words = ([f"TTFT p{wl.ttft.percentile:g} {_s(p.ttft_q)} over {_s(wl.ttft.seconds)}"] if ttft else []) + (
        [f"ITL p{wl.itl.percentile:g} {_s(p.itl_q)} over {_s(wl.itl.seconds)}"] if itl else [])
    return "misses " + " and ".join(words)


def search(start: Fleet, grow: Callable[[Fleet, tuple[bool, bool]], Fleet], shrink: Callable[[Fleet], list[Fleet]],
           evaluate: Callable[[Fleet], Prediction], wl: Workload, max_workers: int) -> Sized:
    """From `start`, one worker at a time: down while both targets hold, up while one is missed
    (and while more workers still help: STALLED grows without a 1% gain end the search)."""
    seen: dict[Fleet, Prediction] = {}

    def ev(f: Fleet) -> Prediction:
        if f not in seen:
            seen[f] = evaluate(f)
        return seen[f]

    def meets(f: Fleet) -> bool:
        return not any(ev(f).misses(wl))

    fleet = start
    if meets(fleet):
        while len(seen) < MAX_SIMULATIONS:
            smaller = [g for g in shrink(fleet) if meets(g)]
            if not smaller:
                break
            fleet = min(smaller, key=lambda g: ev(g).worst_ratio(wl))
        return Sized(fleet.layout, fleet, seen[fleet], None, len(seen))
    best, stalled = ev(fleet).worst_ratio(wl), 0
    while not meets(fleet):
        p = ev(fleet)
        if fleet.workers >= max_workers or len(seen) >= MAX_SIMULATIONS or stalled >= STALLED:
            why = ("more workers stopped helping" if stalled >= STALLED
                   else f"stopped at {fleet.workers} workers ({len(seen)} simulations)")
            return Sized(fleet.layout, fleet, p, f"{missed_words(p, wl)}; {why}", len(seen))
        fleet = grow(fleet, p.misses(wl))
        ratio = ev(fleet).worst_ratio(wl)
        stalled = 0 if ratio < 0.99 * best else stalled + 1
        best = min(best, ratio)
    return Sized(fleet.layout, fleet, seen[fleet], None, len(seen))


def size_disaggregated(cap: Capacity, wl: Workload, seats: int, evaluate: Callable[[Fleet], Prediction],
                       max_workers: int, block: int) -> Sized:
    """Prefill and decode workers; decode's chunk for the prompts it prefills itself (when prefill is
    saturated) keeps such a step within GAP_FACTOR ordinary steps at its typical batch."""
    p, d = planner_sizes(cap, wl, seats)
    decode = max(1, math.ceil(d))
    typical = typical_batch(cap, wl, decode)
    chunk = max(block, chunk_within(cap, typical, GAP_FACTOR * cap.step_s(typical), block))
    start = Fleet(Layout.DISAGGREGATED, max(1, math.ceil(p)), decode, chunk)

    def grow(f: Fleet, missed: tuple[bool, bool]) -> Fleet:
        return replace(f, prefill=f.prefill + missed[0], decode=f.decode + missed[1])

    def shrink(f: Fleet) -> list[Fleet]:
        return ([replace(f, prefill=f.prefill - 1)] if f.prefill > 1 else []) + (
            [replace(f, decode=f.decode - 1)] if f.decode > 1 else [])

    return search(start, grow, shrink, evaluate, wl, max_workers)


def size_colocated(cap: Capacity, wl: Workload, seats: int, evaluate: Callable[[Fleet], Prediction],
                   max_workers: int, block: int) -> Sized:
    """Workers that prefill their own prompts in chunks; the chunk's step beside a worker's typical
    batch must fit the ITL target."""
    p, d = planner_sizes(cap, wl, seats)
    n = typical_batch(cap, wl, max(1, math.ceil(p + d)))
    largest = chunk_within(cap, n, wl.itl.seconds, block)
    if largest < block:
        return Sized(Layout.COLOCATED, None, None,
                     f"a step prefilling even {block} prompt tokens beside {n} streams takes "
                     f"{_s(cap.chunk_step_s(n, block))}, over the ITL target of {_s(wl.itl.seconds)}: only "
                     "separate prefill workers keep the gaps within it")
    chunks = sorted({max(block, largest // 2 ** i // block * block) for i in range(CHUNK_CHOICES)}, reverse=True)
    best: Sized | None = None
    for chunk in chunks:
        start = Fleet(Layout.COLOCATED, 0, max(1, math.ceil(p + d)), chunk)
        sized = search(start, lambda f, _missed: replace(f, decode=f.decode + 1),
                       lambda f: [replace(f, decode=f.decode - 1)] if f.decode > 1 else [], evaluate, wl, max_workers)
        if best is None or _better(sized, best, wl):
            best = sized
    return best


def _better(a: Sized, b: Sized, wl: Workload) -> bool:
    """Whether `a` is the better recommendation: meets the targets, fewer workers, more margin."""
    if (a.problem is None) != (b.problem is None):
        return a.problem is None
    if a.fleet is None or b.fleet is None:
        return b.fleet is None and a.fleet is not None
    if a.problem is not None:  # neither meets the targets: the nearer one
        return a.prediction.worst_ratio(wl) < b.prediction.worst_ratio(wl)
    return (a.fleet.workers, a.prediction.worst_ratio(wl)) < (b.fleet.workers, b.prediction.worst_ratio(wl))


def recommend(cap: Capacity, wl: Workload, *, layouts: tuple[Layout, ...] = tuple(Layout), max_workers: int = 1000,
              requests: int = 2000, seed: int = 0, block: int = 16, headroom: float = HEADROOM) -> Plan:
    """The smallest fleet within the workload's targets (less `headroom`), per layout, and which
    layout to run."""
    problem = unreachable(cap, wl)
    goal = wl.within(1.0 - headroom)
    seats = cap.seats_within(goal.itl.seconds)
    if problem is not None:
        none = Sized(layouts[0], None, None, problem)
        return Plan(wl, seats, none, (), problem)

    def evaluate(f: Fleet) -> Prediction:
        return predict(cap, goal, f, requests=requests, seed=seed)

    sizers = {Layout.DISAGGREGATED: size_disaggregated, Layout.COLOCATED: size_colocated}
    sized = [sizers[layout](cap, goal, seats, evaluate, max_workers, block) for layout in layouts]
    chosen = sized[0]
    for s in sized[1:]:
        if _better(s, chosen, goal):
            chosen = s
    others = tuple(s for s in sized if s is not chosen)
    return Plan(wl, seats, chosen, others, _why(chosen, others, goal))


def _why(chosen: Sized, others: tuple[Sized, ...], wl: Workload) -> str:
    if chosen.problem is not None:
        return f"no layout meets the targets: {chosen.problem}"
    words = f"{chosen.fleet.describe()}: the fewest workers within both targets in the simulator"
    for o in others:
        if o.fleet is None or o.problem is not None:
            words += f"; {o.layout}: {o.problem}"
        else:
            words += (f"; {o.fleet.layout} needs {o.fleet.workers} worker{'s' * (o.fleet.workers != 1)} "
                      f"(worst latency at {o.prediction.worst_ratio(wl):.2f} of its target)")
    return words
