"""The operator's planner in the loop of a simulated fleet: each interval it reads the fleet's
metrics as the operator parses them from /metrics (the router's own histogram buckets) and its
replica decisions are applied, as the operator applies them."""

from __future__ import annotations

from collections import Counter

from prometheus_client import generate_latest
from tandem.operator.spec.autoscaling import AutoscalingSpec
from tandem.planning.autoscaling.planner import PlannerState, plan
from tandem.planning.autoscaling.scrape import parse_router
from tandem.planning.autoscaling.snapshot import MetricsWindow
from tandem.planning.simulation import ROLES, Simulation
from tandem.router.metrics import RouterMetrics


def router_bounds() -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The router's own TTFT and ITL histogram buckets (the planner reads percentiles through them)."""
    r = parse_router(generate_latest(RouterMetrics().registry).decode())
    return r.ttft.bounds, r.itl.bounds


class PlannerPolicy:
    name = "planner"

    def __init__(self, spec: AutoscalingSpec):
        self.spec = spec
        self.window = MetricsWindow(spec.window_s)
        self.state = PlannerState()
        self.reasons: Counter[tuple[str, str]] = Counter()

    def __call__(self, sim: Simulation, now: float) -> dict[str, tuple[int, tuple[str, ...]]]:
        self.window = self.window.add(sim.scrape())
        current = {r: sim.provisioned(r) for r in ROLES}
        decision, self.state = plan(self.window.snapshot(), current, self.spec, self.state, now)
        for role, d in decision.roles.items():
            if d.desired != d.current:
                self.reasons[(role, str(d.reason))] += 1
        return {role: (d.desired, d.remove) for role, d in decision.roles.items()}
