"""How cost grows with work (issue 23 point 5): TTFT against prompt length, ITL p50/p99 and output
throughput against concurrency (the batch a decode worker runs), for Tandem disaggregated, Tandem
colocated and vLLM; and the KV handoff's time against prompt length beside the loopback bound.

    python -m bench curves [--arms disagg-bf16 colo2-c128-bf16 vllm-bf16] [--prompt-lens 128,...]

Each arm is started alone (bench/lib/arm_specs.py), warmed up, then: one request at a time for
each prompt length (--ttft-reps each, 2 output tokens: TTFT is the prefill and the handoff), then
closed loops of --concurrency streams (256-token prompts, --output-len out, two rounds of requests
per stream). The handoff's curve comes from kv_handoff's latest result (bench/results/kv_handoff/).
The figure goes to bench/figures/curves.png unless --no-figure. The cores are shared: read the
curves' shape, not single points.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from pathlib import Path

from bench.lib.arm_specs import CATALOG, arm_for, peers_or_skip
from bench.lib.loadgen import run_closed_loop, token_counter
from bench.lib.metrics import summarize
from bench.lib.models import ENGINE_MODEL, bench_model_dir
from bench.lib.ready import served_model
from bench.lib.results import ROOT, latest_result
from bench.lib.workload import WorkloadSpec, plan

FIGURE = "bench/figures/curves.png"


async def ttft_curve(url: str, model: str, count, lens: list[int], reps: int) -> dict[str, dict]:
    out = {}
    for n in lens:
        reqs = plan(WorkloadSpec(f"ttft-{n}", "closed", reps, (n, n), 2, concurrency=1, seed=n), count)
        recs = await run_closed_loop(url, model, reqs, 1, 600.0)
        ttfts = [r.ttft for r in recs if r.ok]
        out[str(n)] = {"ttft_p50": statistics.median(ttfts) if ttfts else None, "ttft": ttfts,
                       "errors": sum(not r.ok for r in recs)}
        print(f"  prompt {n:5d}: TTFT p50 {out[str(n)]['ttft_p50']}", flush=True)
    return out


async def concurrency_curve(url: str, model: str, count, levels: list[int], output_len: int) -> dict[str, dict]:
    out = {}
    for c in levels:
        reqs = plan(WorkloadSpec(f"c{c}", "closed", 2 * c, (256, 256), output_len, concurrency=c, seed=c), count)
        sm = summarize(await run_closed_loop(url, model, reqs, c, 600.0), [])
        out[str(c)] = {"itl_p50": sm["itl"]["p50"], "itl_p99": sm["itl"]["p99"], "ttft_p50": sm["ttft"]["p50"],
                       "output_tokens_per_s": sm["output_tokens_per_s"], "errors": sm["errors"]}
        print(f"  {c:3d} streams: ITL p50 {sm['itl']['p50']:.4f} p99 {sm['itl']['p99']:.4f}, "
              f"{sm['output_tokens_per_s']:.0f} tok/s", flush=True)
    return out


async def measure(args: argparse.Namespace) -> dict:
    model_dir = bench_model_dir(ENGINE_MODEL)
    count = token_counter(model_dir)
    specs, skipped = peers_or_skip([CATALOG[n] for n in args.arms])
    lens = [int(x) for x in args.prompt_lens.split(",")]
    levels = [int(x) for x in args.concurrency.split(",")]
    arms: dict[str, dict] = {}
    for spec in specs:
        arm = arm_for(spec, spec.name, model_dir, Path(args.out_dir) / "logs", tuple(args.worker_arg))
        arm.start()
        try:
            await arm.wait_ready(args.ready_timeout_s)
            model = await served_model(arm.url)
            await run_closed_loop(arm.url, model, plan(WorkloadSpec("warm", "closed", 2, (512, 512), 4), count), 2)
            print(f"{spec.name}:", flush=True)
            arms[spec.name] = {"description": spec.describe(),
                               "ttft": await ttft_curve(arm.url, model, count, lens, args.ttft_reps),
                               "concurrency": await concurrency_curve(arm.url, model, count, levels, args.output_len)}
        finally:
            arm.stop()
    handoff = latest_result("kv_handoff")
    return {"arms": arms, "skipped_arms": skipped, "prompt_lens": lens, "concurrency": levels,
            "output_len": args.output_len, "handoff": handoff_curve(handoff["result"]) if handoff else None,
            "handoff_run": handoff["run_id"] if handoff else None}


def handoff_curve(kv: dict) -> dict[str, dict]:
    """Per prompt length: KV bytes, NIXL and TCP pull time, and the loopback and memcpy bounds."""
    return {n: {"bytes": kv["nixl"][n]["bytes"], "nixl_s": kv["nixl"][n]["latency_s"],
                "tcp_s": kv["tcp"][n]["latency_s"], "raw_tcp_s": kv["raw_tcp"][n]["latency_s"],
                "memcpy_s": kv["memcpy"][n]["latency_s"]} for n in kv["summary"]}


def plot(res: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(11, 8))
    for name, a in res["arms"].items():
        lens = [int(n) for n, v in a["ttft"].items() if v["ttft_p50"] is not None]
        ax[0][0].plot(lens, [a["ttft"][str(n)]["ttft_p50"] for n in lens], "o-", label=name)
        cs = [int(c) for c in a["concurrency"]]
        line = ax[0][1].plot(cs, [a["concurrency"][str(c)]["itl_p50"] for c in cs], "o-", label=f"{name} p50")
        ax[0][1].plot(cs, [a["concurrency"][str(c)]["itl_p99"] for c in cs], "s--", color=line[0].get_color(),
                      label=f"{name} p99")
        ax[1][0].plot(cs, [a["concurrency"][str(c)]["output_tokens_per_s"] for c in cs], "o-", label=name)
    if res["handoff"]:
        h = res["handoff"]
        ns = [int(n) for n in h]
        for key, label in (("nixl_s", "NIXL pull"), ("tcp_s", "TCP pull"), ("raw_tcp_s", "raw loopback TCP (bound)"),
                           ("memcpy_s", "memcpy")):
            ax[1][1].plot(ns, [h[str(n)][key] for n in ns], "o-", label=label)
        ax[1][1].set_title(f"KV handoff (kv_handoff run {res['handoff_run']}); MiB: "
                           + ", ".join(f"{int(n)}: {h[n]['bytes'] / 2**20:.0f}" for n in h), fontsize=8)
    titles = [("prompt tokens", "TTFT p50 (s)"), ("concurrent streams", "ITL (s)"),
              ("concurrent streams", "output tokens/s"), ("prompt tokens", "handoff time (s)")]
    for a, (x, y) in zip([ax[0][0], ax[0][1], ax[1][0], ax[1][1]], titles, strict=True):
        a.set_xscale("log", base=2)
        a.set_xlabel(x)
        a.set_ylabel(y)
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:  # the handoff panel is empty until kv_handoff has run
            a.legend(fontsize=7)
    ax[0][0].set_yscale("log")
    ax[0][1].set_yscale("log")
    ax[1][1].set_yscale("log")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arms", nargs="+", default=["disagg-bf16", "colo2-c128-bf16", "vllm-bf16"], choices=list(CATALOG),
                   metavar="ARM")
    p.add_argument("--prompt-lens", default="128,256,512,1024,2048,4000",
                   help="the model's context is 4096 tokens: 8k needs a longer one")
    p.add_argument("--ttft-reps", type=int, default=3)
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64,128")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--worker-arg", action="append", default=[], help="an extra `tandem worker` flag")
    p.add_argument("--ready-timeout-s", type=float, default=1200.0)
    p.add_argument("--no-figure", action="store_true", help=f"write the figure under the run's out folder, not {FIGURE}")


def run(args: argparse.Namespace) -> dict:
    res = asyncio.run(measure(args))
    path = Path(args.out_dir) / "curves.png" if args.no_figure else ROOT / FIGURE
    print(f"wrote {plot(res, path)}")
    return res
