"""Autoscaling, simulated: a day replayed against the planner, a fixed peak-sized fleet and a ratio
policy, at several scales (bench/simulator/).

    python -m bench autoscale_sim [--sizes 2,10,50,200] [--day-hours 4]

Each scale is set by the peak arrival rate at which the fixed fleet (sized for each role's busiest
hour) has `size` replicas. All policies see the same requests (same seed). Prints a markdown table
(SLO attainment, latency, replica-seconds); the result holds every run; the table and a PNG
(replicas over the day and SLO attainment per hour) for one scale go to
bench/out/autoscale_sim/<run-id>/. Replica capacity comes from bench/simulator/capacity_cpu.json
(`python -m bench calibrate`).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict
from pathlib import Path

from bench.lib.results import scenario_settings
from bench.simulator.capacity import cpu_capacity
from bench.simulator.policies import size_for_peak
from bench.simulator.replay import POLICIES, Result, plot, simulate, table


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--sizes", default="2,10,50,200", help="fixed-fleet sizes at the peak (prefill + decode)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--day-hours", type=float, default=24.0, help="the day is replayed in this many hours")
    ap.add_argument("--ttft", type=float, default=3.0, help="TTFT target (p90), seconds")
    ap.add_argument("--itl", type=float, default=0.1, help="ITL target (p90), seconds; also the TPOT SLO")
    ap.add_argument("--percentile", type=float, default=90, help="the planner's target percentile")
    ap.add_argument("--target-margin", type=float, default=1.0,
                    help="the planner's latency targets as a fraction of the SLO (1: the SLO itself)")
    ap.add_argument("--prefill-min", type=int, default=0)
    ap.add_argument("--startup-s", type=float, default=60.0)
    ap.add_argument("--export-outstanding", action="store_true",
                    help="workers export tandem_worker_outstanding_prompt_tokens (today's do not)")
    ap.add_argument("--fine-buckets", action="store_true", help="finer router histogram buckets near the targets")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot-size", type=int, default=None, help="the scale to plot (default: the second)")
    ap.add_argument("--replot", default=None, help="only redraw the plot from this result file")


def replot(args: argparse.Namespace) -> dict:
    saved = json.loads(Path(args.replot).read_text())
    saved = saved.get("result", saved)  # a result file's envelope, or the bare result
    args.day_hours, args.ttft, args.itl = (saved["args"][k] for k in ("day_hours", "ttft", "itl"))
    rows = [Result(**r) for r in saved["results"]]
    sizes = sorted({r.size for r in rows})
    size = args.plot_size or sizes[min(1, len(sizes) - 1)]
    path = Path(args.out_dir) / f"autoscale_sim_{size}.png"
    plot([r for r in rows if r.size == size], path, args)
    print(f"wrote {path}")
    return {"replotted": args.replot, "figure": str(path)}


def run(args: argparse.Namespace) -> dict:
    if args.replot:
        return replot(args)
    cap = cpu_capacity(startup_s=args.startup_s)
    unit = size_for_peak(cap, 1.0, args.itl)
    per_rps = unit.prefill + unit.decode  # rounding makes this a slight overestimate; resized below
    results: list[Result] = []
    sizes = [int(s) for s in args.sizes.split(",")]
    for size in sizes:
        peak = size / per_rps
        fleet = size_for_peak(cap, peak, args.itl)
        while fleet.total < size:
            peak *= 1.02
            fleet = size_for_peak(cap, peak, args.itl)
        for policy in args.policies.split(","):
            r = simulate(policy, cap, fleet, peak, size, args)
            results.append(r)
            print(f"size {size:4d} {policy:8s} requests {r.requests:8d} SLO {r.attainment:6.1%} "
                  f"replica-h {sum(r.replica_s.values()) / 3600:8.1f} ({r.wall_s:.0f} s)", flush=True)
    out = Path(args.out_dir)
    md = table(results)
    print(md)
    (out / "table.md").write_text(md + "\n")
    plot_size = args.plot_size or sizes[min(1, len(sizes) - 1)]
    plot([r for r in results if r.size == plot_size], out / f"autoscale_sim_{plot_size}.png", args)
    print(f"wrote {out}/table.md, autoscale_sim_{plot_size}.png; "
          f"median wall per run {statistics.median(r.wall_s for r in results):.0f} s")
    settings = scenario_settings(args)
    return {"args": settings, "capacity": asdict(cap), "results": [asdict(r) for r in results]}
