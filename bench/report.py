"""The benchmark's outputs: a JSON file, PNG plots, and the results section of BENCHMARKS.md.

The table formatting is pure (unit-tested); only write_outputs touches the disk.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path
from typing import Any

from bench.metrics import RequestRecord, get_path

BEGIN = "<!-- bench:results:begin (written by `make bench`; edit outside these markers) -->"
END = "<!-- bench:results:end -->"


def json_safe(x: Any) -> Any:
    """NaN and infinities become null, so the file is strict JSON."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [json_safe(v) for v in x]
    return x


def fmt_s(x: float | None) -> str:
    """Seconds for a table: ms below one second."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x * 1000:.0f} ms" if abs(x) < 1 else f"{x:.2f} s"


def fmt_num(x: float | None, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{digits}f}"


def fmt_ratio(s: dict[str, float] | None) -> str:
    """'median [min–max]' over repetitions; just the value when there is one."""
    if not s or s.get("n", 0) == 0 or s.get("median") is None or math.isnan(s["median"]):
        return "–"
    if s["n"] == 1 or s["min"] == s["max"]:
        return f"{s['median']:.2f}"
    return f"{s['median']:.2f} [{s['min']:.2f}–{s['max']:.2f}]"


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def median_over_reps(runs: list[dict[str, Any]], workload: str, arm: str, path: str) -> float:
    v = [get_path(r["summary"], path) for r in runs if r["workload"] == workload and r["arm"] == arm]
    v = [x for x in v if not math.isnan(x)]
    return statistics.median(v) if v else math.nan


def results_markdown(result: dict[str, Any]) -> str:
    """The generated part of BENCHMARKS.md: set-up figures, per-arm tables, ratio table."""
    runs = result["runs"]
    arms = result["arms"]
    workloads = [w["name"] for w in result["workloads"]]
    slo_names = [s["name"] for s in result["slos"]]
    cal = result["calibration"]
    m = result["model"]
    reps = {w: len({r["rep"] for r in runs if r["workload"] == w}) for w in workloads}
    out = [
        f"Run `{result['started_utc']}` (UTC), {result['wall_s'] / 60:.1f} min wall"
        + (" — **quick smoke run, not a measurement**" if result.get("quick") else "") + ".",
        "",
        f"- Host: {result['host']['cpus']} CPUs, {result['host']['platform']}, Python "
        f"{result['host']['python']}; load average (1/5/15 min) at the start "
        f"{', '.join(f'{x:.1f}' for x in result['host'].get('loadavg_at_start', []))}, at the end "
        f"{', '.join(f'{x:.1f}' for x in result['host']['loadavg_at_end'])}.",
        f"- Model: random-init Llama, {m['params'] / 1e6:.1f}M parameters, {m['num_layers']} layers, "
        f"hidden {m['hidden_size']}, {m['num_heads']} heads / {m['num_kv_heads']} KV heads, {m['dtype']}; "
        f"KV {m['kv_bytes_per_token'] / 1024:.0f} KiB per token.",
        f"- Calibration on the colocated arm: isolated prefill of {cal['isolated_prefill_tokens']} tokens "
        f"**{fmt_s(cal['isolated_prefill_s'])}** (P), isolated decode step **{fmt_s(cal['isolated_step_s'])}** (D), "
        f"capacity **{cal['capacity_rps']:.2f} req/s** ({cal.get('capacity_workload', '')}).",
        f"- SLOs for goodput: {'; '.join(slo_names)} (TTFT at most a multiple of P and every "
        "inter-token gap at most a multiple of D).",
        "- Idle CPU of each arm before the runs (cores): "
        + ", ".join(f"{k} {v:.2f}" for k, v in result["idle_cpu_cores"].items()) + ".",
        "- Workloads (requests per run x repetitions that fitted the budget): "
        + "; ".join(f"{w['name']} {w['num_requests']}x{reps[w['name']]}"
                    + (f" at {w['rate']:.2f} req/s" if w["mode"] == "poisson" else "")
                    for w in result["workloads"]) + ".",
        "- Left out to stay within the time budget: "
        + (", ".join(result.get("skipped_for_budget") or []) or "nothing") + ".",
        "",
        "### Latency per arm (median over repetitions)",
        "",
    ]
    header = ["workload", "arm", "TTFT p50", "p90", "p99", "max", "ITL p50", "p90", "p99", "max",
              "TPOT p50", "p99", "err", "text≠"]
    rows = []
    for w in workloads:
        for a in arms:
            if not any(r["workload"] == w and r["arm"] == a for r in runs):
                continue
            g = lambda p, w=w, a=a: median_over_reps(runs, w, a, p)  # noqa: E731
            rows.append([w, a, *(fmt_s(g(f"ttft.{q}")) for q in ("p50", "p90", "p99", "max")),
                         *(fmt_s(g(f"itl.{q}")) for q in ("p50", "p90", "p99", "max")),
                         fmt_s(g("tpot.p50")), fmt_s(g("tpot.p99")),
                         fmt_num(g("errors"), 0), fmt_num(g("text_mismatches"), 0)])
    out += [md_table(header, rows), "", "### Throughput, goodput, handoff and CPU (median over repetitions)", ""]
    header = ["workload", "arm", "req/s", "tok/s", *(f"goodput {n}" for n in slo_names),
              "KV MiB/req", "handoff", "handoff/TTFT", "router CPU", "loadgen CPU", "idle arms CPU", "other CPU"]
    rows = []
    for w in workloads:
        for a in arms:
            if not any(r["workload"] == w and r["arm"] == a for r in runs):
                continue
            g = lambda p, w=w, a=a: median_over_reps(runs, w, a, p)  # noqa: E731
            rows.append([w, a, fmt_num(g("throughput_rps")), fmt_num(g("output_tokens_per_s"), 0),
                         *(f"{fmt_num(g(f'goodput.{n}.goodput_rps'))} ({fmt_num(100 * g(f'goodput.{n}.attainment'), 0)}%)"
                           for n in slo_names),
                         fmt_num(g("kv_bytes_per_request") / 2**20, 1), fmt_s(g("handoff_s_per_request")),
                         fmt_pct(g("handoff_share_of_ttft")), fmt_pct(g("router_cpu_cores")),
                         fmt_pct(g("loadgen_cpu_cores")), fmt_pct(g("idle_arms_cpu_cores")),
                         fmt_pct(g("other_cpu_cores"))])
    out += [md_table(header, rows), "",
            "Goodput is requests/s meeting the SLO (in brackets: the share of requests that did). "
            "CPU is in percent of one core over the run; \"idle arms CPU\" is what the arms not "
            "under test burned meanwhile (they stay up, idle, on the same pinned cores); \"other "
            "CPU\" is what the machine was busy with outside this benchmark's processes (other "
            "users of the shared cores): where either is large, that run is disturbed.", "",
            "### Ratios disaggregated / colocated (median [range] over repetitions; < 1 is lower)", ""]
    keys = ["ttft.p50", "ttft.p99", "itl.p50", "itl.p99", "itl.max", "tpot.p50", "throughput_rps",
            *(f"goodput.{n}.goodput_rps" for n in slo_names)]
    header = ["workload", "arm", *[k.replace(".goodput_rps", "").replace("goodput.", "goodput ")
                                   for k in keys]]
    rows = []
    for w in workloads:
        for a in arms:
            d = result["ratios"].get(f"{w}|{a}")
            if d is not None:
                rows.append([w, a, *(fmt_ratio(d.get(k)) for k in keys)])
    out += [md_table(header, rows), ""]
    return "\n".join(out)


def fmt_pct(x: float) -> str:
    return "–" if x is None or math.isnan(x) else f"{100 * x:.0f}%"


def replace_section(doc: str, section: str) -> str:
    """Put the generated section between the markers, keeping everything else as written."""
    block = f"{BEGIN}\n{section}\n{END}"
    if BEGIN in doc and END in doc:
        return re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _: block, doc, flags=re.S)
    return doc.rstrip() + "\n\n## Results\n\n" + block + "\n"


def plot(result: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    arms = result["arms"]
    def recs(w: str, a: str, rep: int | None = None) -> list[RequestRecord]:
        return [RequestRecord.from_dict(d) for r in runs if r["workload"] == w and r["arm"] == a
                and (rep is None or r["rep"] == rep) for d in r["records"]]

    open_loop = [w["name"] for w in result["workloads"] if w["mode"] == "poisson"]
    paths = []
    for metric, label in (("ttft", "time to first token (s)"), ("itl", "inter-token gap (s)")):
        if not open_loop:
            break
        fig, axes = plt.subplots(1, len(open_loop), figsize=(5 * len(open_loop), 4), squeeze=False)
        for ax, w in zip(axes[0], open_loop, strict=True):
            for a in arms:
                rs = [r for r in recs(w, a) if r.ok]
                v = sorted([r.ttft for r in rs] if metric == "ttft" else [g for r in rs for g in r.gaps])
                if v:
                    ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=a)
            ax.set_title(w)
            ax.set_xlabel(label)
            ax.set_xscale("log")
            ax.set_ylabel("fraction")
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        path = out_dir / f"{metric}_cdf.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    if open_loop:
        # One request's token timeline per arm: the one with the worst stall in the colocated arm.
        w = open_loop[-1]
        base = [r for r in recs(w, arms[0], rep=0) if r.ok and r.gaps]
        if base:
            pick = max(base, key=lambda r: max(r.gaps))
            fig, ax = plt.subplots(figsize=(7, 4))
            for a in arms:
                for r in recs(w, a, rep=0):
                    if r.index == pick.index and r.ok and r.send_s is not None:
                        ax.step([t - r.send_s for t in r.chunk_times_s],
                                range(1, len(r.chunk_times_s) + 1), where="post", label=a)
                        break
            ax.set_title(f"{w}, repetition 0: request {pick.index} (the worst stall in {arms[0]})")
            ax.set_xlabel("seconds since sent")
            ax.set_ylabel("tokens received")
            ax.grid(alpha=0.3)
            ax.legend()
            fig.tight_layout()
            path = out_dir / "token_timeline.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            paths.append(path)
    return paths


def write_outputs(result: dict[str, Any], out_dir: Path, markdown: Path | None) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(json_safe(result), indent=1)
    paths = [out_dir / f"bench-{result['started_utc']}.json", out_dir / "latest.json"]
    for p in paths:
        p.write_text(text)
    paths += plot(result, out_dir)
    if markdown is not None:
        doc = markdown.read_text() if markdown.exists() else "# Benchmarks\n"
        markdown.write_text(replace_section(doc, results_markdown(result)))
        paths.append(markdown)
    return paths
