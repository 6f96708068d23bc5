"""`tandem plan` against a measured run: calibrate the interference model quietly on one pinned core,
predict the interference load on the fleets its arms ran, and set each prediction beside what the
latest interference run measured (issue 23 point 6).

    python -m bench plan_check [--interference RUN_ID] [--dtype bfloat16]

`make bench` runs it right after `interference`, so the calibration and the run it is checked
against come from one sitting. The calibration (the same measurement as `tandem plan --model DIR
--save-calibration F --cpus N`) is in the result and in the run's out dir, so the prediction can be
repeated with `tandem plan --calibration bench/out/plan_check/<run>/calibration.json --fleet ...`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

# interference arm -> the fleet it runs, as `tandem plan --fleet P+D [--decode-chunk C]`
ARM_FLEETS = {"disagg-bf16": (1, 1, None), "disagg-fp32": (1, 1, None), "colo2-c128-bf16": (0, 2, 128),
              "colo2-c256-bf16": (0, 2, 256), "colo2-c128-fp32": (0, 2, 128), "colo2-c256-fp32": (0, 2, 256)}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--interference", default=None,
                    help="the interference run to check against (default: the latest result)")
    ap.add_argument("--dtype", default="bfloat16", help="the calibration's dtype (default: the arms' bf16); "
                    "the arms of this dtype are checked")
    ap.add_argument("--calibration", type=Path, default=None,
                    help="read this calibration (an earlier run's calibration.json) instead of measuring now")
    ap.add_argument("--core", type=int, default=None, help="pin the calibration to this core (default: the last)")
    ap.add_argument("--repeats", type=int, default=2, help="calibration repeats (the least time per point)")
    ap.add_argument("--ttft", type=float, default=0.5, help="the TTFT target of the recommendation, seconds")
    ap.add_argument("--itl", type=float, default=0.05, help="the ITL p99 target of the recommendation, seconds")
    ap.add_argument("--plan-requests", type=int, default=400, help="requests per simulation of the recommendation")


DTYPE_TAGS = {"bfloat16": "bf16", "float32": "fp32"}


def measured(run: dict, dtype: str = "bfloat16") -> dict[str, dict]:
    """Per interference arm of this dtype that runs one of Tandem's fleets: TTFT p50 and ITL p50 / p99
    of every repetition."""
    out: dict[str, dict] = {}
    for r in run["result"]["runs"]:
        if r["arm"] not in ARM_FLEETS or not r["arm"].endswith(DTYPE_TAGS[dtype]) or not r.get("summary"):
            continue
        s = r["summary"]
        row = out.setdefault(r["arm"], {"ttft_p50": [], "itl_p50": [], "itl_p99": [], "routes": []})
        row["ttft_p50"].append(s["ttft"]["p50"])
        row["itl_p50"].append(s["itl"]["p50"])
        row["itl_p99"].append(s["itl"]["p99"])
        row["routes"].append(r.get("routes", {}))
    return out


def calibrate(model_dir: Path, dtype: str, core: int, repeats: int, out_dir: Path) -> dict:
    from tandem.planning.calibrate import measure_pinned

    cal = measure_pinned(model_dir, {core}, 1, dtype=dtype, repeats=repeats, say=lambda line: print(line, flush=True))
    cal["model_dir"] = str(model_dir)
    (out_dir / "calibration.json").write_text(json.dumps(cal, indent=2) + "\n")
    return cal


def compare(cap, wl, seed: int, requests: int, meas: dict[str, dict]) -> list[dict]:
    from tandem.planning.predict import Fleet, Layout, predict

    rows = []
    for arm, m in sorted(meas.items()):
        p, d, chunk = ARM_FLEETS[arm]
        fleet = Fleet(Layout.COLOCATED if p == 0 else Layout.DISAGGREGATED, p, d, chunk)
        pred = predict(cap, wl, fleet, requests=requests, seed=seed)
        med = statistics.median(m["ttft_p50"])
        rows.append({"arm": arm, "fleet": f"{fleet.describe()} ({arm})", "predicted": {
            "ttft_p50": pred.ttft_p50, "itl_p50": pred.itl_p50, "itl_p99": pred.itl_q, "requests": pred.requests},
            "measured": m, "ttft_p50_ratio": pred.ttft_p50 / med if med else None,
            "itl_p99_ratio": pred.itl_q / statistics.median(m["itl_p99"])})
    return rows


def run(args: argparse.Namespace) -> dict:
    from tandem.planning.capacity import Capacity
    from tandem.planning.manifest import render
    from tandem.planning.recommend import recommend
    from tandem.planning.workload import Workload

    from bench.lib.results import read_result

    run_ = read_result("interference", args.interference)
    if run_ is None:
        return {"ok": False, "error": "no interference result to check against: run `python -m bench interference`"}
    if args.dtype not in DTYPE_TAGS:
        return {"ok": False, "error": f"--dtype {args.dtype}: the interference arms run {', '.join(DTYPE_TAGS)}"}
    meas = measured(run_, args.dtype)
    w = run_["result"]["workload"]
    model_dir = Path(run_["result"]["model"]["dir"])
    core = args.core if args.core is not None else (os.cpu_count() or 1) - 1
    if args.calibration:
        cal = json.loads(args.calibration.read_text())
    else:
        cal = calibrate(model_dir, args.dtype, core, args.repeats, args.out_dir)
    cap = Capacity.from_dict(cal)
    low, high = w["prompt_len"]
    wl = Workload.from_dict({"rate": w["rate"], "prompt": f"{low}-{high}", "output": w["output_len"],
                             "targets": {"ttft": {"seconds": args.ttft}, "itl": {"seconds": args.itl, "percentile": 99}}})
    rows = compare(cap, wl, w["seed"], w["num_requests"], meas)
    plan = recommend(cap, wl, requests=args.plan_requests, seed=w["seed"])
    for r in rows:
        print(f"{r['fleet']}: predicted TTFT p50 {r['predicted']['ttft_p50']:.2f} s, ITL p50/p99 "
              f"{r['predicted']['itl_p50'] * 1e3:.0f}/{r['predicted']['itl_p99'] * 1e3:.0f} ms; measured TTFT p50 "
              f"{', '.join(f'{x:.2f}' for x in r['measured']['ttft_p50'])} s, ITL p99 "
              f"{', '.join(f'{x * 1e3:.0f}' for x in r['measured']['itl_p99'])} ms", flush=True)
    text = render(plan, cap, "calibration.json (this run)")
    print(text, end="")
    chosen = plan.chosen.fleet
    return {"ok": True, "interference_run": run_["run_id"], "workload": wl.describe(), "calibration": cal,
            "fit": cal["fit"], "fleets": rows,
            "recommendation": {"chosen": chosen.describe() if chosen else None, "layout": str(plan.chosen.layout),
                               "problem": plan.chosen.problem, "why": plan.why, "text": text}}
