"""Native forward pass against the transformers path on the same Llama: decode throughput at N
streams (default 32), one engine in-process on one CPU thread, fp32.

    .venv/bin/python -m bench model_paths [--streams 32] [--reps 5] [--new-tokens 48]

Model: issue 13's random ~42M-parameter Llama (bench/lib/models.py). Arms: `native` (the
hand-written pass, its decode step compiled where a C++ compiler is found, as a worker runs it),
`native-eager` (compile off: what the compiler adds) and `transformers` (the model's own classes
with Tandem's paged attention, eager). Each repetition runs every arm on the same prompts, in a
rotating order (the cores are shared: read the spread). Throughput counts only steps in which
every stream decodes; the outputs of all arms are checked equal.
"""

from __future__ import annotations

import argparse
import statistics
import time

ARMS = {"native": ("native", "auto"), "native-eager": ("native", "off"), "transformers": ("transformers", "off")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--arms", default=",".join(ARMS))


def decode_rate(engine, prompts: list[list[int]], new_tokens: int, tag: str) -> tuple[float, list[list[int]]]:
    """Tokens per second over the steps where every stream decodes; and the outputs."""
    from tandem.testing.engine_helpers import greedy, run_to_completion, submit, tokens_of

    steps: list[tuple[float, int]] = []
    engine.on_step = lambda s, n: steps.append((s, n))
    outs = [submit(engine, f"{tag}-{i}", p, greedy(new_tokens)) for i, p in enumerate(prompts)]
    run_to_completion(engine)
    full = [s for s, n in steps if n == len(prompts)][1:]
    return len(prompts) * len(full) / sum(full), [tokens_of(o) for o in outs]


def run(args: argparse.Namespace) -> dict:
    import torch
    from tandem.worker.engine.config import EngineConfig
    from tandem.worker.engine.engine import Engine
    from tandem.worker.engine.loader import load_model

    from bench.lib.models import engine_model_dir

    torch.set_num_threads(1)
    model_dir = str(engine_model_dir())
    arms = args.arms.split(",")
    engines = {}
    for arm in arms:
        backend, compile_ = ARMS[arm]
        t0 = time.monotonic()
        loaded = load_model(model_dir, dtype="float32", device="cpu", backend=backend)
        engines[arm] = Engine(EngineConfig(model=model_dir, num_blocks=args.streams * 8 + 16,
                                           max_num_seqs=args.streams, max_batched_tokens=args.streams * args.prompt_len,
                                           compile=compile_), loaded=loaded)
        print(f"{arm}: ready in {time.monotonic() - t0:.1f}s", flush=True)
    gen = torch.Generator().manual_seed(0)
    rates: dict[str, list[float]] = {arm: [] for arm in arms}
    for arm in arms:  # warm-up: first steps allocate and (native) load compiled code
        decode_rate(engines[arm], [[1, 2, 3, 4]] * 2, 4, f"warm-{arm}")
    for rep in range(args.reps):
        prompts = [torch.randint(3, 32000, (args.prompt_len,), generator=gen).tolist() for _ in range(args.streams)]
        outputs = {}
        for arm in arms[rep % len(arms):] + arms[: rep % len(arms)]:
            rate, outputs[arm] = decode_rate(engines[arm], prompts, args.new_tokens, f"{arm}-{rep}")
            rates[arm].append(rate)
        assert all(o == outputs[arms[0]] for o in outputs.values()), "the arms' greedy outputs differ"
        print(" ".join(f"{arm} {rates[arm][-1]:.0f} tok/s" for arm in arms), flush=True)
    median = {arm: statistics.median(r) for arm, r in rates.items()}
    result = {"streams": args.streams, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "model": "engine-llama42m (bench/lib/models.py), float32, 1 thread",
              "tokens_per_s": rates, "median_tokens_per_s": median}
    for base in ("native", "native-eager"):
        if base in rates and "transformers" in rates:
            # Per repetition (the arms ran back to back on the same prompts), then the median.
            paired = [t / b for t, b in zip(rates["transformers"], rates[base], strict=True)]
            result[f"transformers_over_{base.replace('-', '_')}"] = {"median": statistics.median(paired),
                                                                     "per_rep": paired}
    return result
