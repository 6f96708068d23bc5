"""`tandem plan`: how many prefill and decode workers a workload needs, their chunk sizes, and
whether to disaggregate at all, from one worker's measured capacity (tandem.planning).

    tandem plan --calibration worker.json --rate 4 --prompt-tokens 300-1000 --output-tokens 64 \\
        --ttft 1.5 --itl 0.05 --itl-percentile 99
    tandem plan --model DIR --dtype bfloat16 --save-calibration worker.json --workload workload.yaml

Prints the InferenceService fields to apply (YAML) with the figures behind them as comments.
Imports nothing heavy until run: measuring (--model) loads torch and the engine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_argument_group("the capacity of one worker (one of)")
    src.add_argument("--calibration", type=Path, help="a calibration file (--save-calibration)")
    src.add_argument("--model", help="measure this model folder now, in this process (minutes)")
    src.add_argument("--dtype", default="auto", help="the dtype to measure in (default: the worker's choice, auto)")
    src.add_argument("--threads", type=int, default=1, help="compute threads of the measured worker (default 1)")
    src.add_argument("--cpus", default=None, help="pin the measurement to these CPUs, e.g. 0 or 0-3")
    src.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                     help="the measured worker's --compile (default auto, as a worker)")
    src.add_argument("--save-calibration", type=Path, help="write what --model measured here")
    wl = parser.add_argument_group("the workload (a file, or flags; flags win)")
    wl.add_argument("--workload", type=Path, help="YAML: rate, prompt, output, targets (tandem.planning.workload)")
    wl.add_argument("--rate", type=float, help="requests per second (Poisson)")
    wl.add_argument("--prompt-tokens", help="prompt lengths: N, LOW-HIGH, lognormal:MEDIAN:SIGMA[:MAX]")
    wl.add_argument("--output-tokens", help="answer lengths, as --prompt-tokens")
    wl.add_argument("--ttft", type=float, help="time-to-first-token target, seconds (default 2)")
    wl.add_argument("--ttft-percentile", type=float, help="percentile held to --ttft (default 90)")
    wl.add_argument("--itl", type=float, help="inter-token latency target, seconds (default 0.1)")
    wl.add_argument("--itl-percentile", type=float, help="percentile held to --itl (default 90)")
    out = parser.add_argument_group("the recommendation")
    out.add_argument("--layout", choices=["auto", "disaggregated", "colocated"], default="auto",
                     help="size only this layout (default: both, and say which to run)")
    out.add_argument("--max-workers", type=int, default=1000, help="the largest fleet to consider")
    out.add_argument("--requests", type=int, default=2000, help="requests per simulation (more: steadier tails)")
    out.add_argument("--headroom", type=float, default=0.1,
                     help="the simulated percentiles must come this fraction under the targets (default 0.1)")
    out.add_argument("--seed", type=int, default=0)
    out.add_argument("--autoscaling", action="store_true", help="also print spec.autoscaling around the fleet")
    out.add_argument("--fleet", metavar="P+D", help="only predict this fleet (P=0: colocated), e.g. to set "
                     "beside a measured run")
    out.add_argument("--decode-chunk", type=int, default=None, help="with --fleet: decode's prefill chunk")
    out.add_argument("--json", action="store_true", help="the plan as JSON instead of YAML")


def workload_dict(args: argparse.Namespace) -> dict:
    """The workload file's keys, overridden by the flags given."""
    import yaml

    d = yaml.safe_load(args.workload.read_text()) if args.workload else {}
    if not isinstance(d, dict):
        raise ValueError(f"{args.workload}: a workload file is a mapping (rate, prompt, output, targets)")
    for flag, key in (("rate", "rate"), ("prompt_tokens", "prompt"), ("output_tokens", "output")):
        if getattr(args, flag) is not None:
            d[key] = getattr(args, flag)
    targets = d.setdefault("targets", {}) or {}
    d["targets"] = targets
    for name in ("ttft", "itl"):
        given = {"seconds": getattr(args, name), "percentile": getattr(args, f"{name}_percentile")}
        t = dict(targets.get(name) or {})
        t.update({k: v for k, v in given.items() if v is not None})
        targets[name] = t
    return d


def capacity(args: argparse.Namespace):
    """The worker's capacity, from a file or measured now; and where it came from."""
    from tandem.planning.capacity import Capacity

    if (args.calibration is None) == (args.model is None):
        raise ValueError("give the worker's capacity: --calibration FILE or --model DIR (one of them)")
    if args.calibration is not None:
        return Capacity.from_calibration(args.calibration), str(args.calibration)
    from tandem.planning.calibrate import measure_pinned

    print(f"# measuring {args.model} ({args.dtype}, {args.threads} thread(s)) ...", file=sys.stderr, flush=True)
    result = measure_pinned(Path(args.model), _cpus(args.cpus) if args.cpus else None, args.threads, dtype=args.dtype,
                            compile=args.compile, say=lambda line: print(f"#   {line}", file=sys.stderr))
    if args.save_calibration:
        args.save_calibration.write_text(json.dumps(result, indent=2) + "\n")
    return Capacity.from_dict(result), f"measured now: {args.model}, {result['dtype']}, {args.threads} thread(s)"


def _cpus(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out |= set(range(int(lo), int(hi or lo) + 1))
    return out


def run(args: argparse.Namespace) -> int:
    from tandem.planning.manifest import fleet_report, render
    from tandem.planning.predict import Fleet, Layout, predict
    from tandem.planning.recommend import recommend
    from tandem.planning.workload import Workload

    try:
        wl = Workload.from_dict(workload_dict(args))
        cap, source = capacity(args)
    except (ValueError, OSError) as e:
        print(f"tandem plan: {e}", file=sys.stderr)
        return 2
    if args.fleet:
        p, plus, d = args.fleet.partition("+")
        if not (plus and p.isdigit() and d.isdigit() and int(d) >= 1):
            print(f"tandem plan: --fleet {args.fleet!r}: write PREFILL+DECODE, e.g. 1+1 (0+2: two colocated)",
                  file=sys.stderr)
            return 2
        fleet = Fleet(Layout.COLOCATED if int(p) == 0 else Layout.DISAGGREGATED, int(p), int(d), args.decode_chunk)
        print(fleet_report(fleet, predict(cap, wl, fleet, requests=args.requests, seed=args.seed), wl), end="")
        return 0
    layouts = tuple(Layout) if args.layout == "auto" else (Layout(args.layout),)
    plan = recommend(cap, wl, layouts=layouts, max_workers=args.max_workers, requests=args.requests, seed=args.seed,
                     headroom=args.headroom)
    if args.json:
        from dataclasses import asdict

        print(json.dumps(asdict(plan), indent=2, default=str))
    else:
        print(render(plan, cap, source, args.autoscaling), end="")
    return 0 if plan.chosen.problem is None else 1
