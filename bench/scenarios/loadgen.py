"""Load against any OpenAI-compatible server: streaming completions, open or closed loop, and the
latency summary (TTFT, ITL, TPOT, throughput) as `vllm bench serve` defines it.

    python -m bench loadgen --url http://127.0.0.1:8000 --model-dir DIR --rate 0.5 -n 10

Open loop (Poisson at --rate requests/s) when --rate > 0, else --concurrency requests in flight.
Prompts are random words sized with the served model's tokenizer (--model-dir). Every request's
chunk times go to bench/out/loadgen/<run-id>/records.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from bench.lib.loadgen import run_workload, token_counter
from bench.lib.metrics import summarize
from bench.lib.ready import served_model
from bench.lib.workload import WorkloadSpec, plan


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="base URL of the OpenAI-compatible server")
    p.add_argument("--model", default="", help="model name to send (default: the server's first)")
    p.add_argument("--model-dir", required=True, help="the served model folder (for its tokenizer)")
    p.add_argument("-n", "--num-requests", type=int, default=8)
    p.add_argument("--rate", type=float, default=0.0, help="Poisson requests/s (open loop)")
    p.add_argument("--concurrency", type=int, default=1, help="closed loop when --rate is 0")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(256, 1024), metavar=("LO", "HI"))
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout-s", type=float, default=300.0)


def run(args: argparse.Namespace) -> dict:
    spec = WorkloadSpec("cli", "poisson" if args.rate > 0 else "closed", args.num_requests,
                        tuple(args.prompt_len), args.output_len, rate=args.rate, concurrency=args.concurrency,
                        seed=args.seed)
    reqs = plan(spec, token_counter(args.model_dir))
    model = args.model or asyncio.run(served_model(args.url))
    records = asyncio.run(run_workload(args.url, model, spec, reqs, args.request_timeout_s))
    summary = summarize(records)
    print(json.dumps(summary, indent=2))
    (args.out_dir / "records.json").write_text(json.dumps([r.to_dict() for r in records]))
    return {"url": args.url, "model": model, "spec": spec.__dict__, "summary": summary}
