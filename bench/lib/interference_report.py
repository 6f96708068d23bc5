"""The interference scenario's report: its section of BENCHMARKS.md, PNG plots and the committed
summary (pure but for write_outputs())."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from bench.lib.metrics import RequestRecord, spread
from bench.lib.tables import (
    Section,
    fmt_num,
    fmt_pct,
    fmt_ratio,
    fmt_s,
    fmt_s_range,
    md_table,
    median_range,
    without_records,
    write_full,
)

SECTION = Section("interference", "python -m bench interference", "## Results")
# Issue 29: Tandem on vLLM, disaggregated, over plain vLLM colocated (the peer), the same repetition.
RUNTIME_TARGETS = (("itl.p99", 0.7), ("itl.p50", 1.1), ("ttft.p50", 1.3))


def all_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """compare.targets(), but a Tandem-on-vLLM disaggregated arm has issue 29's targets (against the peer)."""
    from bench.lib.compare import _ratio_row, targets

    ours = {a for a, m in result["arms"].items() if m.get("runtime") == "vllm" and not m.get("peer")}
    rows = [t for t in targets(result["runs"], result["arms"], result["comparison"]) if t["arm"] not in ours]
    return rows + [_ratio_row(a, f"{m} Tandem-on-vLLM disaggregated / {peer}", bound, pr[m])
                   for a, c in result["comparison"].items() if a in ours
                   for peer, pr in c.get("peers", {}).items() for m, bound in RUNTIME_TARGETS]


def _header(result: dict[str, Any]) -> list[str]:
    m, w, h = result["model"], result["workload"], result["host"]
    reps = {a: len([r for r in result["runs"] if r["arm"] == a]) for a in result["arms"]}
    other = [r["summary"]["other_cpu_cores"] for r in result["runs"]]
    return [
        f"Run `{result['started_utc']}` (UTC), {result['wall_s'] / 60:.1f} min wall"
        + (" — **quick smoke run, not a measurement**" if result.get("quick") else "") + f": `{result['command']}`.",
        "",
        f"- Host: {h['cpus']} CPUs, {h['platform']}, Python {h['python']}; load average (1/5/15 min) at the "
        f"start {', '.join(f'{x:.1f}' for x in h['loadavg_at_start'])}, at the end "
        f"{', '.join(f'{x:.1f}' for x in h['loadavg_at_end'])}. CPU the machine spent outside this "
        f"benchmark's processes during a run (other users of the shared cores): "
        f"{fmt_pct(min(other, default=math.nan))}-{fmt_pct(max(other, default=math.nan))} of a core.",
        f"- Model: random-init Llama, {m['params'] / 1e6:.1f}M parameters, {m['num_layers']} layers, hidden "
        f"{m['hidden_size']}, {m['num_heads']} heads / {m['num_kv_heads']} KV heads, intermediate "
        f"{m['intermediate_size']}, vocabulary {m['vocab_size']}"
        + (", tied embeddings" if m.get("tie_word_embeddings") else "") + ".",
        f"- Load: {w['num_requests']} requests, Poisson at {w['rate']:g} req/s, prompts of {w['prompt_len'][0]}-"
        f"{w['prompt_len'][1]} tokens, {w['output_len']} out (ignore_eos, greedy); the same requests for every "
        "arm within a repetition, new ones each repetition.",
        "- Runs per arm: " + ", ".join(f"{a} {n}" for a, n in reps.items())
        + "; left out for the time budget: " + (", ".join(result["skipped_for_budget"]) or "nothing") + ".",
    ]


def _arm_tables(result: dict[str, Any]) -> list[str]:
    runs = result["runs"]
    rows, cpu_rows = [], []
    for a, meta in result["arms"].items():
        g = lambda p, a=a: median_range(runs, a, p)  # noqa: E731
        rows.append([a, meta["description"], fmt_s_range(g("ttft.p50")), fmt_s(g("ttft.p99")["median"]),
                     fmt_s_range(g("itl.p50")), fmt_s_range(g("itl.p99")), fmt_s_range(g("itl.max")),
                     fmt_num(g("output_tokens_per_s")["median"], 1), fmt_num(g("errors")["median"], 0),
                     fmt_num(sum(r["summary"]["text_mismatches"] for r in runs if r["arm"] == a), 0)])
        workers = {}
        for r in runs:
            if r["arm"] == a:
                for k, v in r["summary"]["worker_cpu_cores"].items():
                    workers.setdefault(k, []).append(v)
        routes: dict[str, float] = {}
        for r in runs:
            if r["arm"] == a:
                for k, v in r.get("routes", {}).items():
                    routes[k] = routes.get(k, 0.0) + v
        cpu_rows.append([a, ", ".join(f"{k} {fmt_pct(spread(v)['median'])}" for k, v in workers.items()),
                         fmt_pct(g("router_cpu_cores")["median"]), fmt_pct(g("loadgen_cpu_cores")["median"]),
                         fmt_pct(g("other_cpu_cores")["median"]),
                         fmt_num(g("kv_bytes_per_request")["median"] / 2**20, 1), fmt_s(g("handoff_s_per_request")["median"]),
                         ", ".join(f"{k} {v:.0f}" for k, v in sorted(routes.items())) or "–"])
    header = ["arm", "configuration", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "ITL max", "tok/s", "err",
              "text≠"]
    cpu_header = ["arm", "worker CPU", "router CPU", "loadgen CPU", "other CPU", "KV MiB/req", "handoff",
                  "routes (all runs)"]
    return ["### Per arm (median [range] over repetitions)", "", md_table(header, rows), "",
            "text≠: requests whose greedy text differed from the first arm of the same dtype to run them "
            "(fp32 must be 0; bf16 is reported only). CPU in percent of one core over the run; \"other "
            "CPU\" is what the machine was busy with outside this benchmark's processes.", "",
            md_table(cpu_header, cpu_rows), ""]


def _comparison(result: dict[str, Any]) -> list[str]:
    keys = ("ttft.p50", "ttft.p99", "itl.p50", "itl.p99", "itl.max", "output_tokens_per_s")
    rows = [[name, ", ".join(c["against"]), *(fmt_ratio(c["ratios"][k]) for k in keys),
             ", ".join(f"{k}: {c['best_colocated'][k]}" for k in ("ttft.p50", "itl.p50", "itl.p99"))]
            for name, c in result["comparison"].items()]
    header = ["disaggregated", "against (same dtype)", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "ITL max",
              "tok/s", "best colocated arm (most often)"]
    out = ["### Disaggregated / best colocated (per repetition and metric; median [range]; < 1 is lower)", "",
           md_table(header, rows), ""]
    peer_rows = [[name, peer, *(fmt_ratio(pr[k]) for k in keys)]
                 for name, c in result["comparison"].items() for peer, pr in c.get("peers", {}).items()]
    if peer_rows:
        out += ["### Disaggregated / vLLM (the same repetition; median [range]; < 1 is lower)", "",
                md_table(["disaggregated", "peer", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "ITL max", "tok/s"],
                         peer_rows), ""]
    for name, reason in result.get("skipped_arms", {}).items():
        out += [f"- `{name}` not run: {reason}.", ""]
    return out


def _targets(result: dict[str, Any]) -> list[str]:
    rows = []
    for t in all_targets(result):
        shown = (f"{t['measured']:.2f}" if t["kind"] == "ratio" else fmt_s(t["measured"]))
        bound = f"<= {t['bound']:g}" if t["kind"] == "ratio" else f"<= {fmt_s(t['bound'])}"
        verdict = "met" if t["met"] else f"missed ({t['factor']:.2f}x the bound)"
        rows.append([t["arm"], t["target"], bound, shown, verdict])
    return ["### Issues 13, 23 and 29's latency targets in this run", "",
            md_table(["arm", "target", "bound", "measured", ""], rows), ""]


def _profiles(result: dict[str, Any]) -> list[str]:
    out = ["### Where the time goes under this load (py-spy)", ""]
    for arm, prof in result.get("profiles", {}).items():
        if "error" in prof:
            out += [f"- {arm}: not profiled: {prof['error']}.", ""]
            continue
        lat = prof["latency"]
        out += [f"`{arm}`, one more run of the load under `py-spy record --threads --nonblocking` (not in the "
                f"tables above; TTFT p50 {fmt_s(lat['ttft_p50'])}, ITL p50 {fmt_s(lat['itl_p50'])}, p99 "
                f"{fmt_s(lat['itl_p99'])}): share of samples per thread, and of the engine thread's samples by "
                "what it was doing (`bench/lib/pyspy.py`).", ""]
        rows = []
        for role, s in prof["workers"].items():
            rows += [[role, k, fmt_pct(v)] for k, v in s["threads"].items() if v >= 0.005]
            rows += [[role, f"engine: {k}", fmt_pct(v)] for k, v in s["engine"].items() if v >= 0.005]
        out += [md_table(["worker", "where", "share"], rows), ""]
    return out


FIGURES = ("interference_cdf.png", "interference_timeline.png")


def results_markdown(result: dict[str, Any]) -> str:
    """The generated part of BENCHMARKS.md: set-up, per-arm tables, ratios, targets, profile, figures."""
    out = [*_header(result), "", *_arm_tables(result), *_comparison(result), *_targets(result), *_profiles(result)]
    out += [f"![{f.removesuffix('.png').replace('_', ' ')}](bench/figures/{f})" for f in FIGURES]
    return "\n".join(out) + "\n"


def _records(result: dict[str, Any], arm: str, rep: int | None = None) -> list[RequestRecord]:
    return [RequestRecord.from_dict(d) for r in result["runs"] if r["arm"] == arm
            and (rep is None or r["rep"] == rep) for d in r["records"]]


def plot(result: dict[str, Any], fig_dir: Path) -> list[Path]:
    """Small PNGs: per arm (all repetitions pooled) the TTFT CDF and the gaps' tail, and one request's
    token timeline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    arms = list(result["arms"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for a in arms:
        rs = [r for r in _records(result, a) if r.ok]
        style = "-" if result["arms"][a]["disaggregated"] else "--"
        ttft = sorted(r.ttft for r in rs)
        if ttft:  # CDF of TTFT
            axes[0].plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=a, linestyle=style)
        gaps = sorted(g for r in rs for g in r.gaps)
        if gaps:  # the tail of the gaps: the share of gaps longer than x, on log-log axes
            axes[1].plot(gaps, [1 - i / len(gaps) for i in range(len(gaps))], label=a, linestyle=style)
    axes[0].set_xlabel("time to first token (s)")
    axes[0].set_ylabel("fraction of requests")
    axes[1].set_xscale("log")
    axes[1].set_yscale("log")
    axes[1].set_xlim(left=1e-3)
    axes[1].set_xlabel("inter-token gap (s)")
    axes[1].set_ylabel("fraction of gaps >= x")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    paths = [fig_dir / FIGURES[0]]
    fig.savefig(paths[0], dpi=80)
    plt.close(fig)
    # The request with the worst stall of any colocated arm in repetition 0, as every arm streamed it.
    colo = [a for a in arms if not result["arms"][a]["disaggregated"]]
    worst = max(((max(r.gaps), r.index) for a in colo for r in _records(result, a, 0) if r.ok and r.gaps), default=None)
    if worst is not None:
        fig, ax = plt.subplots(figsize=(7, 3.6))
        for a in arms:
            for r in _records(result, a, 0):
                if r.index == worst[1] and r.ok and r.send_s is not None:
                    ax.step([t - r.send_s for t in r.chunk_times_s], range(1, len(r.chunk_times_s) + 1),
                            where="post", label=a, linestyle="-" if result["arms"][a]["disaggregated"] else "--")
        ax.set_title(f"repetition 0, request {worst[1]}: the worst colocated stall", fontsize=9)
        ax.set_xlabel("seconds since sent")
        ax.set_ylabel("tokens received")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(fig_dir / FIGURES[1])
        fig.savefig(paths[1], dpi=80)
        plt.close(fig)
    return paths


def summary_json(result: dict[str, Any]) -> dict[str, Any]:
    """The committed summary, with the targets."""
    return without_records(result) | {"targets": all_targets(result)}


def write_outputs(result: dict[str, Any], out_dir: Path, root: Path | None) -> list[Path]:
    """The full JSON under out_dir; with root (the repository), also the figures and BENCHMARKS.md's
    generated section, else the figures under out_dir."""
    if root is None:
        return [write_full(result, out_dir), *plot(result, out_dir)]
    return [write_full(result, out_dir), *plot(result, root / "bench" / "figures"),
            SECTION.write(results_markdown(result), root / "BENCHMARKS.md")]
