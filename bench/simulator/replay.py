"""Replaying a day against the planner, a fixed peak-sized fleet and a ratio policy at one scale,
and the table and plot of the results (`python -m bench autoscale_sim` drives it)."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tandem.operator.autoscaling.spec import AutoscalingSpec
from tandem.planning.capacity import Capacity
from tandem.planning.planner_loop import PlannerPolicy
from tandem.planning.planner_loop import router_bounds as planner_router_bounds
from tandem.planning.simulation import Simulation

from bench.lib.metrics import percentile
from bench.simulator.policies import FixedPolicy, Fleet, RatioPolicy
from bench.simulator.trace import day, load_shape

POLICIES = ("planner", "fixed", "ratio")


@dataclass
class Result:
    policy: str
    size: int
    peak_rps: float
    fleet: dict
    requests: int
    attainment: float  # share of requests with TTFT and TPOT within their targets
    ttft_missed: float  # share of requests over the TTFT target
    tpot_missed: float  # share over the TPOT target
    ttft_p50: float
    ttft_p90: float
    tpot_p90: float
    replica_s: dict  # per role
    wall_s: float
    by_hour: list = field(default_factory=list)  # SLO attainment per hour of the day
    timeline: list = field(default_factory=list)  # (t, prefill, decode provisioned, prefill, decode ready)
    reasons: dict = field(default_factory=dict)  # planner: changes per role and reason


# Finer buckets near common targets, to measure what the router's coarse ones cost the planner.
FINE_TTFT = (0.25, 0.75, 1.5, 2.5, 3.0, 4.0, 7.5)
FINE_ITL = (0.03, 0.075, 0.09, 0.11, 0.125, 0.15)


def router_bounds(fine: bool = False) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The router's own histogram buckets (the planner reads percentiles through them), or finer ones."""
    ttft, itl = planner_router_bounds()
    if not fine:
        return ttft, itl
    return tuple(sorted(set(ttft) | set(FINE_TTFT))), tuple(sorted(set(itl) | set(FINE_ITL)))


def planner_spec(fleet: Fleet, ttft: float, itl: float, prefill_min: int, percentile: float = 90) -> AutoscalingSpec:
    return AutoscalingSpec.from_dict({
        "intervalSeconds": 15, "windowSeconds": 60,
        "targets": {"ttft": {"seconds": ttft, "percentile": percentile},
                    "itl": {"seconds": itl, "percentile": percentile}},
        "prefill": {"minReplicas": prefill_min, "maxReplicas": 2 * fleet.prefill},
        "decode": {"minReplicas": 1, "maxReplicas": 2 * fleet.decode},
    })


def simulate(policy: str, cap: Capacity, fleet: Fleet, peak_rps: float, size: int, args) -> Result:
    spec = planner_spec(fleet, args.ttft * args.target_margin, args.itl * args.target_margin, args.prefill_min,
                        args.percentile)
    night = load_shape(0.0)
    if policy == "fixed":
        decide, initial = FixedPolicy(), {"prefill": fleet.prefill, "decode": fleet.decode}
    else:
        initial = {"prefill": max(args.prefill_min, 1, math.ceil(fleet.prefill * night)),
                   "decode": max(1, math.ceil(fleet.decode * night))}
        decide = PlannerPolicy(spec) if policy == "planner" else RatioPolicy(fleet, spec)
    ttft_b, itl_b = router_bounds(args.fine_buckets)
    day_s = args.day_hours * 3600.0
    t0 = time.perf_counter()
    sim = Simulation(cap, day(peak_rps, day_s, args.seed), decide, initial, interval_s=15.0, day_s=day_s,
                     ttft_slo=args.ttft, tpot_slo=args.itl, ttft_bounds=ttft_b, itl_bounds=itl_b, seed=args.seed,
                     export_outstanding=args.export_outstanding).run()
    o = sim.outcomes
    met = sum(o.met_by_hour)
    reasons = {}
    if isinstance(decide, PlannerPolicy):
        reasons = {f"{role}:{reason}": n for (role, reason), n in sorted(decide.reasons.items())}
    return Result(
        policy=policy, size=size, peak_rps=peak_rps, fleet=asdict(fleet), requests=len(o.ttft),
        attainment=met / max(1, len(o.ttft)),
        ttft_missed=sum(x > args.ttft for x in o.ttft) / max(1, len(o.ttft)),
        tpot_missed=sum(x > args.itl for x in o.tpot) / max(1, len(o.tpot)), ttft_p50=percentile(o.ttft, 50), ttft_p90=percentile(o.ttft, 90),
        tpot_p90=percentile(o.tpot, 90), replica_s=dict(sim.replica_seconds), wall_s=time.perf_counter() - t0,
        by_hour=[m / a if a else math.nan for m, a in zip(o.met_by_hour, o.all_by_hour, strict=True)],
        timeline=sim.timeline, reasons=reasons)


def table(results: list[Result]) -> str:
    fixed = {r.size: sum(r.replica_s.values()) for r in results if r.policy == "fixed"}
    lines = ["| fleet at peak (P+D) | peak req/s | requests | policy | SLO met | TTFT missed | TPOT missed "
             "| TTFT p50 | TTFT p90 | TPOT p90 | replica-hours P | D | total | vs fixed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        total = sum(r.replica_s.values())
        lines.append(
            f"| {r.fleet['prefill']}+{r.fleet['decode']} | {r.peak_rps:.2f} | {r.requests} | {r.policy} "
            f"| {r.attainment:.1%} | {r.ttft_missed:.1%} | {r.tpot_missed:.1%} | {r.ttft_p50:.2f} s | {r.ttft_p90:.2f} s | {r.tpot_p90 * 1e3:.0f} ms "
            f"| {r.replica_s['prefill'] / 3600:.1f} | {r.replica_s['decode'] / 3600:.1f} | {total / 3600:.1f} "
            f"| {f'{total / fixed[r.size]:.2f}' if r.size in fixed else '–'} |")
    return "\n".join(lines)


def plot(results: list[Result], path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    style = {"fixed": ("tab:gray", 1.2, 1.0), "ratio": ("tab:orange", 0.6, 0.45),
             "planner": ("tab:blue", 1.6, 1.0)}  # drawn in this order: the planner on top
    hour_s = args.day_hours * 3600.0 / 24.0
    results = sorted(results, key=lambda r: list(style).index(r.policy))
    for r in results:
        colour, width, alpha = style[r.policy]
        hours = [t / hour_s for t, *_ in r.timeline]
        for ax, col, role in ((axes[0], 1, "prefill"), (axes[1], 2, "decode")):
            ax.step(hours, [row[col] for row in r.timeline], where="post", color=colour, alpha=alpha,
                    label=r.policy, linewidth=width)
            ax.set_ylabel(f"{role} replicas")
        axes[2].plot([h + 0.5 for h in range(24)], [100 * x for x in r.by_hour], marker="o", markersize=3,
                     color=colour, label=r.policy)
    load = axes[0].twinx()
    grid = [h / 10 for h in range(240)]
    load.fill_between(grid, [load_shape(h) for h in grid], color="tab:green", alpha=0.08, step="mid")
    load.set_yticks([])
    axes[0].legend(loc="upper left", fontsize=8)
    axes[2].set_ylabel("SLO met (%)")
    axes[2].set_xlabel(f"hour of the day (the day replayed in {args.day_hours:g} h)")
    axes[2].set_xlim(0, 24)
    size = results[0].size
    fig.suptitle(f"Autoscaling simulation: fleet of {size} at peak; TTFT p90 <= {args.ttft:g} s, "
                 f"ITL p90 <= {args.itl * 1e3:.0f} ms", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
