"""Decode-to-decode migration time: K streams on a decode worker, SIGTERM it, how long each stream
waits for its next token.

    python -m bench migration [--streams 8] [--max-tokens 256] [--backend tcp] [--model toy|DIR]

Real processes on loopback (bench/lib/processes.py): a prefill worker, two decode workers (tcp or
nixl KV transfer, one thread each) and a router that alternates the decode workers; K streams run
through it (toy model, greedy, ignore_eos), and once every stream has `--warm` tokens the decode
worker running more of them gets SIGTERM. Reported per migrated sequence: the migration time the
router logs (its MIGRATE line received -> the next worker's first token) as p50/max, and the gap
the client saw across the migration (the longest in the 5 s after the SIGTERM) against the same
stream's ordinary gap (its mean gap before the SIGTERM). Every stream's text is checked against an
undisturbed run first. The machine's cores are shared: read figures as rough.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import threading
import time
from pathlib import Path

from tandem.worker.local.processes import Supervisor

from bench.lib.processes import router_process, thread_env, worker_process

MIGRATED = re.compile(r"request (\w+): migrated from \S+ in ([\d.]+) ms \((kv|recompute|failed)\)")


def _stream(client, model: str, prompt: str, max_tokens: int, out: dict) -> None:
    """One stream: its id and each chunk's arrival time (or the error that ended it)."""
    out["times"], out["text"] = [], ""
    try:
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        for chunk in stream:
            out["id"] = chunk.id
            if chunk.choices and chunk.choices[0].text:
                out["times"].append(time.monotonic())
                out["text"] += chunk.choices[0].text
    except Exception as e:  # noqa: BLE001 - reported by run()
        out["error"] = repr(e)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def run(args: argparse.Namespace) -> dict:
    import openai
    if args.model == "toy":
        from tandem.worker.local.up import toy_model_dir

        model_dir = toy_model_dir()
    else:
        model_dir = Path(args.model)
    sup = Supervisor()
    env = os.environ | thread_env(1) | {"UCX_TLS": os.environ.get("UCX_TLS", "tcp")}
    logs = args.out_dir / "logs"
    try:
        names = ("prefill", "decode-0", "decode-1")
        prefill, *decode = [sup.start(worker_process(n, n.split("-")[0], model_dir, logs / f"{n}.log", None,
                                                     kv_backend=args.backend, env=env)) for n in names]
        sup.wait_ready([prefill, *decode])
        router = sup.start(router_process("router", [prefill, *decode], logs / "router.log",
                                          "--short-prompt-threshold", "0", "--policy", "round-robin", env=env))
        router.wait_ready("/ready", 60)
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        prompts = [f"Stream {i}: a decode pod is removed while its streams are running." for i in range(args.streams)]
        expected = [client.completions.create(model=model, prompt=p, max_tokens=args.max_tokens, temperature=0,
                                              extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
        outs = [{} for _ in prompts]
        threads = []
        for p, out in zip(prompts, outs, strict=True):
            t = threading.Thread(target=_stream, args=(client, model, p, args.max_tokens, out), daemon=True)
            t.start()
            threads.append(t)
        deadline = time.monotonic() + 300
        while min(len(o.get("times", ())) for o in outs) < args.warm:
            if time.monotonic() > deadline or any("error" in o for o in outs):
                raise RuntimeError(f"the streams did not start: {[o.get('error') for o in outs]}")
            time.sleep(0.01)
        running = [w.get_json("/internal/info")["running"] for w in decode]
        leaving = decode[0] if running[0] >= running[1] else decode[1]
        t_sig = time.monotonic()
        leaving.signal(signal.SIGTERM)
        for t in threads:
            t.join(300)
        exit_code = leaving.proc.wait(60)
        return summarize(args, outs, expected, router.log(), t_sig, max(running), exit_code)
    finally:
        sup.stop()


def summarize(args: argparse.Namespace, outs: list[dict], expected: list[str], router_log: str, t_sig: float,
              running: int, exit_code: int) -> dict:
    """Per migrated stream (found in the router's log): the router's migration time, the gap the
    client saw across it and its ordinary gap; and whether every text equals the undisturbed run's."""
    moved = {m.group(1): (float(m.group(2)), m.group(3)) for m in MIGRATED.finditer(router_log)}
    rows = []
    for o in outs:
        rid = o["id"].removeprefix("cmpl-")
        if rid not in moved:
            continue
        times = o["times"]
        before = [t for t in times if t < t_sig]
        # the longest gap the client saw in the 5 s after the SIGTERM: the one the migration made
        across = max(b - a for a, b in zip(times, times[1:], strict=False) if t_sig <= b <= t_sig + 5)
        rows.append({"migration_ms": moved[rid][0], "outcome": moved[rid][1],
                     "ordinary_gap_ms": (before[-1] - before[0]) / (len(before) - 1) * 1e3,
                     "gap_across_ms": across * 1e3})
    mig = [r["migration_ms"] for r in rows]
    gaps = [r["gap_across_ms"] for r in rows]
    ordinary = [r["ordinary_gap_ms"] for r in rows]
    identical = [o["text"] for o in outs] == expected
    return {
        "ok": identical and bool(rows), "backend": args.backend, "streams": args.streams, "max_tokens": args.max_tokens,
        "running_on_leaving_worker": running, "migrated": len(rows),
        "outcomes": {k: sum(r["outcome"] == k for r in rows) for k in ("kv", "recompute", "failed")},
        "texts_identical": identical, "leaving_worker_exit": exit_code,
        "migration_ms": {"p50": _pct(mig, 0.5), "max": max(mig)} if mig else None,
        "client_gap_across_ms": {"p50": _pct(gaps, 0.5), "max": max(gaps)} if gaps else None,
        "client_ordinary_gap_ms": {"p50": _pct(ordinary, 0.5), "max": max(ordinary)} if ordinary else None,
        "rows": rows,
    }


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--warm", type=int, default=32, help="tokens every stream has before the SIGTERM")
    ap.add_argument("--backend", choices=("tcp", "nixl"), default="tcp")
    ap.add_argument("--model", default="toy", help="toy (tandem up's tiny model) or a model folder whose "
                    "tokens all decode to text (the client counts chunks)")
