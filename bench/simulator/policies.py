"""The policies the simulator compares, each called once per interval with the simulation.

- planner: Tandem's planner, the pure `plan()` the operator will run, fed the same typed readings
  the operator reads from /metrics (router histograms, worker gauges and counters):
  tandem.planning.planner_loop.PlannerPolicy.
- fixed: a fleet sized for the peak, never changed.
- ratio: one HPA-like rule on one metric (requests in flight per replica) for the whole service,
  split between prefill and decode by the fixed ratio of the peak fleet: how a service is scaled
  without a planner that tells the two roles apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.operator.autoscaling.spec import AutoscalingSpec
from tandem.planning.capacity import Capacity
from tandem.planning.simulation import Simulation

from bench.simulator.trace import load_shape, mean_lengths


@dataclass(frozen=True)
class Fleet:
    """A fleet sized for the peak, and what the ratio policy derives from it."""

    prefill: int
    decode: int
    peak_in_flight: float

    @property
    def total(self) -> int:
        return self.prefill + self.decode


def size_for_peak(cap: Capacity, peak_rps: float, itl_target: float, utilization: float = 0.8,
                  step_h: float = 0.25) -> Fleet:
    """Each role sized for its own busiest hour (flash crowd included), from the measured capacity,
    with the headroom an operator would leave: prefill pods busy `utilization` of the time, decode
    steps at `utilization` of the ITL target.

    Prefill: arriving prefill seconds per second / utilization. Decode: concurrency by Little's law
    (arrivals x decode time at those seats) / seats.
    """
    seats = cap.seats_within(itl_target * utilization)
    step = cap.step_s(seats)
    p = d = flight = 0.0
    for i in range(int(24 / step_h)):
        h = i * step_h
        rate = peak_rps * max(load_shape(h), load_shape(h + step_h / 2))
        prompt, output = mean_lengths(h)
        prefill_s = cap.prefill_s(int(prompt))
        decode_s = (output - 1) * step
        p = max(p, rate * prefill_s / utilization)
        d = max(d, rate * decode_s / seats)
        flight = max(flight, rate * (prefill_s + decode_s))
    return Fleet(max(1, math.ceil(p)), max(1, math.ceil(d)), flight)


class FixedPolicy:
    name = "fixed"

    def __call__(self, sim: Simulation, now: float) -> dict[str, tuple[int, tuple[str, ...]]]:
        return {}


class RatioPolicy:
    """ceil(in flight / per-replica target), with the HPA's tolerance, down window and step limits."""

    name = "ratio"

    def __init__(self, fleet: Fleet, spec: AutoscalingSpec):
        self.share = fleet.prefill / fleet.total
        self.per_replica = fleet.peak_in_flight / fleet.total
        self.spec = spec
        self.history: list[tuple[float, int]] = []

    def __call__(self, sim: Simulation, now: float) -> dict[str, tuple[int, tuple[str, ...]]]:
        current = sim.provisioned("prefill") + sim.provisioned("decode")
        ratio = sim.in_flight / (self.per_replica * current)
        rec = current if abs(ratio - 1) <= self.spec.tolerance else math.ceil(sim.in_flight / self.per_replica)
        rec = max(2, rec)
        down = self.spec.roles["decode"].scale_down
        up = self.spec.roles["decode"].scale_up
        self.history = [(t, r) for t, r in self.history if t >= now - down.stabilization_s] + [(now, rec)]
        target = min(current, max(r for _, r in self.history)) if rec < current else rec
        if target > current:
            target = min(target, current + up.step_limit(current))
        elif target < current:
            target = max(target, current - down.step_limit(current))
        prefill = max(1, round(target * self.share))
        return {"prefill": (prefill, ()), "decode": (max(1, target - prefill), ())}
