"""The multi-turn benchmark's figures: one run's summary (pure), the BENCHMARKS.md table, a plot.

Hit rate is the share of prompt tokens no worker computed: prefix-cache hits on the workers that
prefill (a decode worker's hits on a pulled prompt saved a transfer, not a computation, and are
counted as bytes saved instead) over the prompt tokens the router reported.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from bench.lib.compare import arm_median
from bench.lib.metrics import distribution, pooled_itl
from bench.lib.tables import Section, fmt_num, fmt_pct, fmt_s, md_table, without_records, write_full

SECTION = Section("multiturn", "python -m bench multiturn", "## Multi-turn chat and the prefix cache (issue 15)")
FIGURE = "bench/figures/multiturn.png"


def summarize_run(run: dict[str, Any]) -> dict[str, Any]:
    """TTFT of first and later turns, ITL, hit rate and KV bytes of one arm's run."""
    recs, turns = run["records"], run["turns"]
    ok = [r for r in recs if r.ok]
    first = [r.ttft for r in ok if turns.get(r.index) == 0]
    later = [r.ttft for r in ok if turns.get(r.index, 0) > 0]
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    workers = run["workers"].values()
    decode = [w for w in workers if w["role"] == "decode"]
    pulled = sum(w["tandem_kv_transfer_bytes_total"] for w in decode)
    saved = sum(w["tandem_worker_kv_pull_saved_bytes_total"] for w in decode)
    bytes_per_token = run.get("kv_bytes_per_token") or 0
    saved_tokens = saved / bytes_per_token if bytes_per_token else 0.0
    hits = sum(w["tandem_worker_prefix_cache_hit_tokens_total"] for w in workers) - saved_tokens
    n = max(1, len(ok))
    return {
        "requests": len(recs), "completed": len(ok), "errors": len(recs) - len(ok),
        "ttft_first": distribution(first), "ttft_later": distribution(later), "itl": distribution(pooled_itl(ok)),
        "prompt_tokens": prompt_tokens,
        "hit_rate": hits / prompt_tokens if prompt_tokens else math.nan,
        "kv_bytes_per_request": pulled / n if decode else math.nan,
        "kv_saved_bytes_per_request": saved / n if decode else math.nan,
        "handoff_held_share": saved / (saved + pulled) if decode and saved + pulled else math.nan,
        "cached_prefix_routes": run.get("routes", {}).get("cached_prefix", 0.0),
        "text_mismatches": len(run.get("text_mismatches", [])),
    }


def headline(result: dict[str, Any]) -> dict[str, float]:
    """Later-turn TTFT p50, prefix-aware over cache-off, per layout; the decode side's share of
    the handoff it held already (not moved) with prefix-aware routing."""
    runs, out = result["runs"], {}
    for layout in ("colocated", "disagg"):
        on, off = f"{layout}-prefix-aware", f"{layout}-cache-off"
        if on in result["arms"] and off in result["arms"]:
            out[f"{layout}_later_ttft_ratio"] = arm_median(runs, on, "ttft_later.p50") / arm_median(runs, off, "ttft_later.p50")
    for arm in ("disagg-least-loaded", "disagg-prefix-aware"):
        if arm in result["arms"]:
            out[f"{arm}_held_share"] = arm_median(runs, arm, "handoff_held_share")
            out[f"{arm}_saved_bytes_per_request"] = arm_median(runs, arm, "kv_saved_bytes_per_request")
    return out


def results_markdown(result: dict[str, Any]) -> str:
    runs, w, m = result["runs"], result["workload"], result["model"]
    reps = len({r["rep"] for r in runs})
    header = ["arm", "TTFT 1st turn p50", "p90", "TTFT later turns p50", "p90", "ITL p50", "p99",
              "hit rate", "KV moved/req", "KV held/req", "tail prefilled by decode", "err", "text≠"]
    rows = []
    for a in result["arms"]:
        g = lambda p, a=a: arm_median(runs, a, p)  # noqa: E731
        mib = lambda x: "–" if math.isnan(x) else f"{x / 2**20:.2f} MiB"  # noqa: E731
        rows.append([a, fmt_s(g("ttft_first.p50")), fmt_s(g("ttft_first.p90")), fmt_s(g("ttft_later.p50")),
                     fmt_s(g("ttft_later.p90")), fmt_s(g("itl.p50")), fmt_s(g("itl.p99")),
                     fmt_pct(g("hit_rate")),
                     mib(g("kv_bytes_per_request")), mib(g("kv_saved_bytes_per_request")),
                     fmt_num(g("cached_prefix_routes"), 0), fmt_num(g("errors"), 0), fmt_num(g("text_mismatches"), 0)])
    h = headline(result)
    lines = [
        f"Run `{result['started_utc']}` (UTC), {result['wall_s'] / 60:.1f} min wall, {reps} repetition(s) "
        "(medians below)" + (" — **quick smoke run, not a measurement**" if result.get("quick") else "") + ".",
        "",
        f"- Host: {result['host']['cpus']} CPUs, shared with other users; load average at the start "
        f"{', '.join(f'{x:.1f}' for x in result['host']['loadavg_at_start'])}, at the end "
        f"{', '.join(f'{x:.1f}' for x in result['host']['loadavg_at_end'])}.",
        f"- Model: random-init Llama, {m['params'] / 1e6:.1f}M parameters, {m['dtype']}, "
        f"KV {m['kv_bytes_per_token'] / 1024:.0f} KiB per token; every worker one thread on its own core.",
        f"- Workload: {w['conversations']} conversations x {w['turns']} turns, a shared system prompt of "
        f"~{w['system_tokens']} tokens, user messages of {w['user_tokens'][0]}-{w['user_tokens'][1]} tokens, "
        f"answers of {w['output_len']} tokens, conversations arriving as a Poisson process at "
        f"{w['rate']} per second, {w['think_s']} s mean think time before each next turn; every turn "
        "resends the whole conversation through /v1/chat/completions (the router tokenizes it with the "
        "chat template).",
        f"- Arms: two colocated workers, or one prefill and one decode worker (KV over tcp; prompts with "
        f"fewer than {result['short_prompt_threshold']} uncached tokens prefilled by the decode worker); "
        "each with the prefix cache off, on with least-loaded routing, on with prefix-aware routing. "
        "Arms run interleaved, the first one rotating per repetition.",
        "",
        md_table(header, rows),
        "",
        "Hit rate: prompt tokens no worker computed, over all prompt tokens. KV moved/held per request: "
        "bytes the decode worker pulled, and bytes it took from its own cache instead. \"Tail prefilled "
        "by decode\": requests the router sent to the decode worker alone because it held all but a "
        "short tail (route `cached_prefix`).",
        "",
    ]
    for layout in ("colocated", "disagg"):
        if f"{layout}_later_ttft_ratio" in h:
            lines.append(f"- {layout}: later-turn TTFT p50, prefix-aware / cache off: "
                         f"**{fmt_num(h[f'{layout}_later_ttft_ratio'])}**.")
    for arm in ("disagg-least-loaded", "disagg-prefix-aware"):
        if f"{arm}_held_share" in h and not math.isnan(h[f"{arm}_held_share"]):
            lines.append(f"- {arm}: the decode worker already held **{100 * h[f'{arm}_held_share']:.0f}%** of the "
                         f"KV of the prompts it pulled ({h[f'{arm}_saved_bytes_per_request'] / 2**20:.2f} MiB "
                         "per request not moved).")
    lines += ["", f"![multi-turn chat: TTFT and KV moved per arm]({FIGURE})"]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, arms = result["runs"], result["arms"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(arms))
    first = [arm_median(runs, a, "ttft_first.p50") for a in arms]
    later = [arm_median(runs, a, "ttft_later.p50") for a in arms]
    ax1.bar([i - 0.2 for i in x], first, 0.4, label="first turn")
    ax1.bar([i + 0.2 for i in x], later, 0.4, label="later turns")
    ax1.set_ylabel("TTFT p50 (s)")
    ax1.set_title("time to first token")
    moved = [arm_median(runs, a, "kv_bytes_per_request") / 2**20 for a in arms]
    held = [arm_median(runs, a, "kv_saved_bytes_per_request") / 2**20 for a in arms]
    ax2.bar(list(x), [0 if math.isnan(v) else v for v in moved], 0.6, label="pulled")
    ax2.bar(list(x), [0 if math.isnan(v) else v for v in held], 0.6,
            bottom=[0 if math.isnan(v) else v for v in moved], label="held by decode (not moved)")
    ax2.set_ylabel("KV MiB per request")
    ax2.set_title("KV handoff per request")
    for ax in (ax1, ax2):
        ax.set_xticks(list(x), [a.replace("-", "\n", 1) for a in arms], fontsize=7)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_outputs(result: dict[str, Any], out_dir: Path, markdown: Path | None) -> list[Path]:
    """The full JSON (records included) under out_dir; with markdown, also the figure and the
    BENCHMARKS.md section, else the figure under out_dir."""
    if markdown is None:
        return [write_full(result, out_dir), plot(result, out_dir / "multiturn.png")]
    return [write_full(result, out_dir), plot(result, markdown.parent / FIGURE), SECTION.write(results_markdown(result), markdown)]


def summary_json(result: dict[str, Any]) -> dict[str, Any]:
    """The committed result: everything but the per-request records, with the headline figures."""
    return without_records(result) | {"headline": headline(result)}
