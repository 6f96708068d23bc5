"""The curves scenario's tables for BENCHMARKS.md (SECTION) and its figure, from its result (pure,
but for plot())."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.lib.load_sampler import load_phrase
from bench.lib.tables import Section, fmt_s, md_table

SECTION = Section("curves", "python -m bench curves", "## Cost against work: curves (issue 23)")


def _mib(b: float | None) -> str:
    return "–" if b is None else f"{b / 2**20:.1f}"


def _head(r: dict[str, Any], run_id: str, command: str) -> list[str]:
    left = r.get("left_out") or {}
    dropped = [f"prompts {', '.join(map(str, left['prompt_lens']))}" if left.get("prompt_lens") else "",
               f"concurrency {', '.join(map(str, left['concurrency']))}" if left.get("concurrency") else ""]
    dropped = [d for d in dropped if d]
    lines = [f"Run `{run_id}` (UTC): `{command}`; grid {r['grid']}"
             + (f" (left out of the full grid: {'; '.join(dropped)})" if dropped else "")
             + f"; {r['ttft_reps']} timed TTFT requests per length after an untimed one, "
               f"{r['output_len']} output tokens per stream in the concurrency loops.", ""]
    for name, a in r["arms"].items():
        load = load_phrase(a.get("loadavg")) or "load average not sampled"
        lines.append(f"- **{name}**: {a['description']}; ready after {a['ready_s']:.0f} s; {load} while measured.")
    lines += [f"- **{name}**: skipped ({why})." for name, why in r.get("skipped_arms", {}).items()]
    return [*lines, ""]


def ttft_table(r: dict[str, Any]) -> str:
    names = list(r["arms"])
    rows = []
    for n in r["prompt_lens"]:
        row = [str(n)]
        for name in names:
            p = r["arms"][name]["ttft"].get(str(n), {})
            routes = p.get("routes") or {}
            other = {k: v for k, v in routes.items() if k != "disaggregated"} if "disaggregated" in routes else {}
            cell = fmt_s(p.get("ttft_p50")) + (f" ({p['errors']} errors)" if p.get("errors") else "")
            row.append(cell + "".join(f" ({v} of {sum(routes.values())} routed {k})" for k, v in other.items()))
        rows.append(row)
    return md_table(["prompt tokens", *[f"{n} TTFT p50" for n in names]], rows)


def concurrency_table(r: dict[str, Any]) -> str:
    names = list(r["arms"])
    rows = []
    for c in r["concurrency"]:
        row = [str(c)]
        for name in names:
            p = r["arms"][name]["concurrency"].get(str(c), {})
            row.append(f"{fmt_s(p.get('itl_p50'))} / {fmt_s(p.get('itl_p99'))}"
                       + (f" ({p['errors']} errors)" if p.get("errors") else ""))
        for name in names:
            tps = r["arms"][name]["concurrency"].get(str(c), {}).get("output_tokens_per_s")
            row.append("–" if tps is None else f"{tps:.0f}")
        rows.append(row)
    header = ["streams", *[f"{n} ITL p50 / p99" for n in names], *[f"{n} tok/s" for n in names]]
    return md_table(header, rows)


def runtime_ratios(r: dict[str, Any], ours: str = "tandem-vllm-disagg-bf16", peer: str = "vllm-bf16") -> list[str]:
    """Issue 29's ratios along the curves: Tandem on vLLM, disaggregated, over plain vLLM (bounds: ITL p99
    0.7, ITL p50 1.1, TTFT 1.3)."""
    a, b = r["arms"].get(ours), r["arms"].get(peer)
    if not (a and b):
        return []
    q = lambda x, y: "–" if not (x and y) else f"{x / y:.2f}"  # noqa: E731
    ttft = [[str(n), q(a["ttft"].get(str(n), {}).get("ttft_p50"), b["ttft"].get(str(n), {}).get("ttft_p50"))]
            for n in r["prompt_lens"]]
    itl = [[str(c), *(q(a["concurrency"].get(str(c), {}).get(k), b["concurrency"].get(str(c), {}).get(k))
                      for k in ("itl_p50", "itl_p99"))] for c in r["concurrency"]]
    return [f"**{ours}** / **{peer}** (issue 29: ITL p99 ≤ 0.7, ITL p50 ≤ 1.1, TTFT ≤ 1.3):", "",
            md_table(["prompt tokens", "TTFT p50"], ttft), "", md_table(["streams", "ITL p50", "ITL p99"], itl), ""]


def handoff_table(r: dict[str, Any]) -> list[str]:
    """The arms' own pulls (bf16, from the decode worker's metrics) and kv_handoff's transports
    against raw loopback TCP and memcpy of the same bytes (its fp32 layout)."""
    out = []
    disagg = {n: a for n, a in r["arms"].items() if any(p.get("pull_bytes") for p in a["ttft"].values())}
    for name, a in disagg.items():
        rows = [[str(n), _mib(p.get("pull_bytes")), fmt_s(p.get("pull_s_p50")),
                 f"{p['pull_bytes'] / p['pull_s_p50'] / 1e9:.2f}" if p.get("pull_bytes") and p.get("pull_s_p50") else "–"]
                for n in r["prompt_lens"] if (p := a["ttft"].get(str(n), {}))]
        out += [f"The handoff inside **{name}** (the decode worker's own pulls, from its /metrics around each "
                "timed request; median):", "", md_table(["prompt tokens", "KV MiB", "pull", "GB/s"], rows), ""]
    h = r.get("handoff")
    if h:
        rows = [[n, _mib(v["bytes"]), fmt_s(v["nixl_s"]), fmt_s(v["tcp_s"]), fmt_s(v["raw_tcp_s"]),
                 fmt_s(v["memcpy_s"]), f"{v['raw_tcp_s'] / v['nixl_s']:.2f}", f"{v['raw_tcp_s'] / v['tcp_s']:.2f}"]
                for n, v in h.items()]
        load = load_phrase(r.get("handoff_loadavg"))
        out += [f"The transports against the machine's bound (`kv_handoff`, run `{r['handoff_run']}`, "
                f"fp32 KV of the 40M layout, median of its pulls{'; ' + load if load else ''}):", "",
                md_table(["prompt tokens", "KV MiB", "NIXL", "TCP", "raw loopback TCP (bound)", "memcpy",
                          "NIXL speed / bound", "TCP speed / bound"], rows), ""]
    else:
        out += ["No kv_handoff result in bench/results/kv_handoff/: the transports' bound is not shown.", ""]
    return out


def results_markdown(r: dict[str, Any], run_id: str, command: str, figure: str | None = None) -> str:
    parts = [*_head(r, run_id, command),
             "TTFT against prompt length (one request at a time, 2 output tokens):", "", ttft_table(r), "",
             "Token gaps and output throughput against concurrent streams (256-token prompts; the streams "
             "in flight are the batch a decode worker runs, split over two workers in the colocated arm):", "",
             concurrency_table(r), "", *runtime_ratios(r), *handoff_table(r)]
    if figure:
        parts += [f"![curves]({figure})", ""]
    return "\n".join(parts).rstrip() + "\n"


def plot(res: dict, path: Path) -> Path:
    """Four panels: TTFT by prompt, ITL p50/p99 by streams, tokens/s by streams, handoff by prompt."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.fonttype"] = "none"  # text as text, not glyph paths: a third of the file
    fig, ax = plt.subplots(2, 2, figsize=(11, 8))
    for name, a in res["arms"].items():
        lens = [int(n) for n, v in a["ttft"].items() if v["ttft_p50"] is not None]
        ax[0][0].plot(lens, [a["ttft"][str(n)]["ttft_p50"] for n in lens], "o-", label=name)
        cs = [int(c) for c, v in a["concurrency"].items() if v["itl_p50"] is not None]
        line = ax[0][1].plot(cs, [a["concurrency"][str(c)]["itl_p50"] for c in cs], "o-", label=f"{name} p50")
        ax[0][1].plot(cs, [a["concurrency"][str(c)]["itl_p99"] for c in cs], "s--", color=line[0].get_color(),
                      label=f"{name} p99")
        ax[1][0].plot(cs, [a["concurrency"][str(c)]["output_tokens_per_s"] for c in cs], "o-", label=name)
        pulls = [int(n) for n, v in a["ttft"].items() if v.get("pull_s_p50")]
        if pulls:
            ax[1][1].plot(pulls, [a["ttft"][str(n)]["pull_s_p50"] for n in pulls], "^-", label=f"{name} pull (bf16)")
    for key, label in (("nixl_s", "NIXL pull"), ("tcp_s", "TCP pull"), ("raw_tcp_s", "raw loopback TCP (bound)"),
                       ("memcpy_s", "memcpy")):
        h = res.get("handoff") or {}
        ns = [int(n) for n in h]
        if ns:
            ax[1][1].plot(ns, [h[str(n)][key] for n in ns], "o-", label=f"{label} (fp32, kv_handoff)")
    titles = [("prompt tokens", "TTFT p50 (s)"), ("concurrent streams", "ITL (s)"),
              ("concurrent streams", "output tokens/s"), ("prompt tokens", "KV handoff time (s)")]
    for a, (x, y) in zip([ax[0][0], ax[0][1], ax[1][0], ax[1][1]], titles, strict=True):
        a.set_xscale("log", base=2)
        a.set_xlabel(x)
        a.set_ylabel(y)
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=7)
    for a in (ax[0][0], ax[0][1], ax[1][1]):
        a.set_yscale("log")
    ax[0][1].set_ylim(bottom=1e-3)  # a gap under 1 ms is two tokens read together, not speed
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, metadata={"Date": None})  # no timestamp: the same result gives the same file
    plt.close(fig)
    return path
