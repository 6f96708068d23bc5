"""Disaggregated against the best colocated configuration, and issue 13's targets: pure functions
over a run's summaries (unit-tested in tests/bench/).

"Best colocated" is taken per metric and per repetition: for each metric, the colocated arm of the
same dtype that did best on it in that repetition (the lowest latency, the highest throughput).
The comparison is against the strongest colocated result on every metric at once, never against
one configuration that happens to lose on some of them.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench.lib.metrics import get_path, ratio, spread

METRICS = ("ttft.p50", "ttft.p90", "ttft.p99", "itl.p50", "itl.p90", "itl.p99", "itl.max", "tpot.p50",
           "output_tokens_per_s")
HIGHER_IS_BETTER = {"output_tokens_per_s", "throughput_rps"}

# Issue 13: (metric, bound) on the ratio disaggregated / best colocated, and absolute bounds (seconds)
# on the disaggregated bf16 arm.
RATIO_TARGETS = (("itl.p99", 0.5), ("itl.p50", 1.1), ("ttft.p50", 1.15))
ABSOLUTE_TARGETS_BF16 = (("ttft.p50", 0.25), ("itl.p50", 0.018), ("itl.p99", 0.030))
# Issue 23: (metric, bound) on the ratio disaggregated / the peer (vLLM) of the same dtype.
PEER_TARGETS = (("ttft.p50", 1.2), ("itl.p50", 1.0), ("itl.p99", 0.7))


def arm_median(runs: list[dict[str, Any]], arm: str, metric: str) -> float:
    """The arm's median of the metric over its repetitions (NaN when it has none)."""
    return spread([get_path(r["summary"], metric) for r in runs if r["arm"] == arm])["median"]


def _best(values: list[tuple[float, str]], metric: str) -> tuple[float, str] | None:
    values = [v for v in values if v[0] == v[0]]  # drop NaN
    if not values:
        return None
    return (max if metric in HIGHER_IS_BETTER else min)(values)


def ratios_to_best(runs: list[dict[str, Any]], arm: str, against: list[str]) -> tuple[dict, dict]:
    """Per metric, the arm's value over the best of `against` in the same repetition (one arm: that
    arm's), and which arm was the best each time."""
    ratios: dict[str, list[float]] = {m: [] for m in METRICS}
    best_by: dict[str, list[str]] = {m: [] for m in METRICS}
    for rep in sorted({r["rep"] for r in runs}):
        mine = next((r for r in runs if r["arm"] == arm and r["rep"] == rep), None)
        theirs = [r for r in runs if r["arm"] in against and r["rep"] == rep]
        if mine is None or not theirs:
            continue
        for m in METRICS:
            best = _best([(get_path(r["summary"], m), r["arm"]) for r in theirs], m)
            if best is not None:
                ratios[m].append(ratio(get_path(mine["summary"], m), best[0]))
                best_by[m].append(best[1])
    return ratios, best_by


def compare(runs: list[dict[str, Any]], arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """For every disaggregated arm: per metric, the ratio to the best colocated arm of its dtype in
    the same repetition (median and range over repetitions), and which arm was best how often; and
    the ratio to each peer (vLLM) of its dtype."""
    out: dict[str, Any] = {}
    for name, meta in arms.items():
        if not meta["disaggregated"]:
            continue
        colo = [a for a, m in arms.items()
                if not m["disaggregated"] and not m.get("peer") and m["dtype"] == meta["dtype"]]
        ratios, best_by = ratios_to_best(runs, name, colo)
        peers = [p for p, pm in arms.items() if pm.get("peer") and pm["dtype"] == meta["dtype"]]
        out[name] = {"dtype": meta["dtype"], "against": colo,
                     "ratios": {m: spread(v) for m, v in ratios.items()},
                     "best_colocated": {m: statistics.mode(v) if v else None for m, v in best_by.items()},
                     "peers": {p: {m: spread(v) for m, v in ratios_to_best(runs, name, [p])[0].items()}
                               for p in peers}}
    return out


def _ratio_row(arm: str, target: str, bound: float, s: dict[str, float]) -> dict[str, Any]:
    v = s["median"]
    return {"arm": arm, "target": target, "kind": "ratio", "bound": bound, "measured": v,
            "range": [s["min"], s["max"]], "met": v <= bound, "factor": v / bound}


def targets(runs: list[dict[str, Any]], arms: dict[str, dict[str, Any]], comparison: dict[str, Any],
            ) -> list[dict[str, Any]]:
    """Issue 13's latency targets and issue 23's against the peer, each with what was measured (a
    median), its bound and whether it was met; `factor` is measured / bound (> 1: missed by that factor)."""
    rows = []
    for name, c in comparison.items():
        rows += [_ratio_row(name, f"{m} disaggregated / best colocated", bound, c["ratios"][m])
                 for m, bound in RATIO_TARGETS]
        rows += [_ratio_row(name, f"{m} disaggregated / {peer}", bound, pr[m])
                 for peer, pr in c.get("peers", {}).items() for m, bound in PEER_TARGETS]
    for name, meta in arms.items():
        if not (meta["disaggregated"] and meta["dtype"] == "bfloat16"):
            continue
        for m, bound in ABSOLUTE_TARGETS_BF16:
            v = arm_median(runs, name, m)
            rows.append({"arm": name, "target": m, "kind": "seconds", "bound": bound, "measured": v,
                         "met": v <= bound, "factor": v / bound})
    return rows
