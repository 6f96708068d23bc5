"""Issue 23's targets (and issue 29's, Tandem on vLLM) from one `make bench` run: each measured figure
read from the result of the default scenario that measured it, Tandem beside vLLM (pure: results in,
rows and markdown out)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from bench.lib.compare import PEER_TARGETS
from bench.lib.interference_report import RUNTIME_TARGETS
from bench.lib.tables import fmt_num, fmt_s, fmt_s_range, md_table, median_range

DISAGG, COLO, PEER, VLLM_DISAGG = "disagg-bf16", "colo2-c128-bf16", "vllm-bf16", "tandem-vllm-disagg-bf16"


@dataclass(frozen=True)
class Row:
    target: str
    bound: str  # as the issue writes it
    measured: float | None
    met: bool | None  # None: not measured in this run
    detail: str  # the figures the ratio is made of
    source: str  # scenario/run-id


def _ratio_row(target: str, bound: float, higher_is_better: bool, value: float | None, detail: str,
               source: str) -> Row:
    met = None if value is None else (value >= bound if higher_is_better else value <= bound)
    return Row(target, f"{'≥' if higher_is_better else '≤'} {bound:g}", value, met, detail, source)


def _ms(x: float) -> str:
    """Seconds as the table shows them: a tenth of a millisecond below 10 ms."""
    return f"{x * 1e3:.1f} ms" if x < 0.01 else fmt_s(x)


def _src(env: dict | None) -> str:
    return f"{env['scenario']}/{env['run_id']}" if env else "–"


def interference_rows(env: dict | None) -> list[Row]:
    """Disaggregated TTFT p50, ITL p50 and ITL p99 over vLLM's (medians of the per-repetition
    ratios), and the first gap after a handoff over the median gap."""
    rows = []
    for arm, bounds, who in ((DISAGG, PEER_TARGETS, "disaggregated"),  # issue 23's bounds
                             (VLLM_DISAGG, RUNTIME_TARGETS, "Tandem-on-vLLM disaggregated")):  # issue 29's
        peer = ((env or {}).get("result", {}).get("comparison", {}).get(arm, {}).get("peers", {}).get(PEER)) or {}
        for metric, bound in bounds:
            kind, quantile = metric.split(".")
            s = peer.get(metric)
            value = s["median"] if s and s.get("n") else None
            detail = f"[{s['min']:.2f}–{s['max']:.2f}] over {s['n']} repetitions" if value is not None else "not run"
            rows.append(_ratio_row(f"interference load: {who} {kind.upper()} {quantile} / vLLM's", bound, False,
                                   value, detail, _src(env)))
    runs = [r for r in (env or {}).get("result", {}).get("runs", []) if r.get("summary")]
    ours, theirs = median_range(runs, DISAGG, "itl.max"), median_range(runs, PEER, "itl.max")
    if ours["n"] and theirs["n"]:
        rows.append(Row("interference load: disaggregated ITL max / vLLM's (no target)", "–",
                        ours["median"] / theirs["median"], None,
                        f"{_ms(ours['median'])} / {_ms(theirs['median'])}", _src(env)))
    first = median_range([r for r in runs if r.get("summary")], DISAGG, "first_gap.p50")
    gap = median_range([r for r in runs if r.get("summary")], DISAGG, "itl.p50")
    value = first["median"] / gap["median"] if first["n"] and gap["n"] else None
    rows.append(_ratio_row("first gap after a handoff / median gap (disaggregated)", 2.0, False, value,
                           f"{_ms(first['median'])} / {_ms(gap['median'])}" if value else "–", _src(env)))
    return rows


def throughput_row(env: dict | None) -> Row:
    s = ((env or {}).get("result", {}).get("summary", {}) or {}).get("bfloat16", {})
    ours, theirs = (s.get("tandem") or {}).get("tokens_per_s"), (s.get("vllm") or {}).get("tokens_per_s")
    value = ours["median"] / theirs["median"] if ours and theirs else None
    detail = (f"{ours['median']:.0f} / {theirs['median']:.0f} tokens/s" if value else "vLLM not run")
    return _ratio_row("decode throughput, 32 streams over HTTP: Tandem / vLLM", 1.0, True, value, detail, _src(env))


def bound_rows(env: dict | None) -> list[Row]:
    """The batch-1 decode step over the memory-bandwidth bound (weights + KV read once per step), the
    bound at the better of the bandwidths measured before and after (a busy spell only lowers one)."""
    rows = []
    res = (env or {}).get("result", {})
    before = (res.get("bandwidth") or {}).get("read_bytes_per_s")
    best = max(before or 0, (res.get("bandwidth_after") or {}).get("read_bytes_per_s") or 0)
    for dtype, d in sorted((res.get("dtypes") or {}).items()):
        b1 = (d.get("batches") or {}).get("1")
        if not b1 or not before:
            continue
        step, bound = statistics.median(b1["tandem_step_s"]), b1["bound_s"] * before / best
        rows.append(_ratio_row(f"batch-1 decode step / memory bound, {dtype}", 1.2, False, step / bound,
                               f"{_ms(step)} / {_ms(bound)} at {best / 1e9:.1f} GB/s", _src(env)))
    return rows


def prefill_rows(env: dict | None, length: str = "2048") -> list[Row]:
    """Prefill at 2k tokens, one request at a time: vLLM's TTFT over each Tandem arm's (tokens/s
    ratio), the disaggregated arm's including its handoff."""
    arms = (env or {}).get("result", {}).get("arms", {})
    peer = (arms.get(PEER, {}).get("ttft") or {}).get(length)
    rows = []
    for arm, name in ((COLO, "colocated"), (DISAGG, "disaggregated")):
        ours = (arms.get(arm, {}).get("ttft") or {}).get(length)
        value = peer["ttft_p50"] / ours["ttft_p50"] if peer and ours else None
        detail = f"TTFT {fmt_s(ours['ttft_p50'])} against {fmt_s(peer['ttft_p50'])}" if value else "vLLM not run"
        rows.append(_ratio_row(f"prefill at {length} tokens ({name}): Tandem / vLLM tokens/s", 1.0, True, value,
                               detail, _src(env)))
    return rows


def plan_rows(env: dict | None) -> list[Row]:
    """How close `tandem plan` came: predicted over measured TTFT p50 and ITL p99, per fleet."""
    rows = []
    for f in (env or {}).get("result", {}).get("fleets", []):
        m = f["measured"]
        for key, name in (("ttft_p50", "TTFT p50"), ("itl_p99", "ITL p99")):
            meas = statistics.median(m[key])
            rows.append(Row(f"tandem plan, {f['fleet']}: predicted / measured {name}", "near 1",
                            f["predicted"][key] / meas if meas else None, None,
                            f"{_ms(f['predicted'][key])} / {_ms(meas)}", _src(env)))
    return rows


def target_rows(results: dict[str, dict | None]) -> list[Row]:
    return [*interference_rows(results.get("interference")), throughput_row(results.get("engine_http")),
            *bound_rows(results.get("engine_decode")), *prefill_rows(results.get("curves")),
            *plan_rows(results.get("plan_check"))]


def arms_table(env: dict | None) -> str:
    """The interference load per arm (median [range] over repetitions)."""
    runs = [r for r in (env or {}).get("result", {}).get("runs", []) if r.get("summary")]
    rows = []
    for arm in dict.fromkeys(r["arm"] for r in runs):
        cells = [median_range(runs, arm, p) for p in ("ttft.p50", "itl.p50", "itl.p99", "itl.max")]
        rows.append([arm, *(fmt_s_range(c) for c in cells)])
    return md_table(["arm (2 cores)", "TTFT p50", "ITL p50", "ITL p99", "ITL max"], rows)


def _met(row: Row) -> str:
    return {True: "**met**", False: "missed", None: "–"}[row.met]


def section(results: dict[str, dict | None]) -> str:
    """The generated section: which runs, the targets, the interference arms."""
    runs = []
    for name, env in results.items():
        if env:
            load = (env.get("host", {}).get("loadavg_during") or {})
            runs.append([f"`{name}`", f"`{env['run_id']}`", f"{env['wall_s'] / 60:.1f} min",
                         fmt_num(load.get("median"), 1), str(env.get("commit") or "–")[:12]])
        else:
            runs.append([f"`{name}`", "not run", "–", "–", "–"])
    targets = [[r.target, r.bound, fmt_num(r.measured), _met(r), r.detail, f"`{r.source}`"]
               for r in target_rows(results)]
    return "\n\n".join([
        md_table(["scenario", "run", "wall", "load avg (median)", "commit"], runs),
        md_table(["target (issues 23, 29)", "bound", "measured", "", "made of", "run"], targets),
        "The interference load (issue 13: 40 requests, 300-1,000-token prompts, 64 tokens out, Poisson 0.6/s):",
        arms_table(results.get("interference")),
    ])
