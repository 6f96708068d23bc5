"""What a grammar mask and top-20 logprobs cost per decode step: the engine in-process, N streams
decoding together (32 by default) on the benchmark model (42M parameters, a 32k vocabulary: the
mask and the top-k scale with it), one thread. Arms, interleaved per repetition: plain greedy (the
runner's argmax), greedy with `logprobs=20`, greedy under a JSON grammar (`json_object`: the
random model writes long strings, so every stream decodes throughout), and both. Reported: the
median step where every stream decodes, and each arm's extra milliseconds per step over plain.
Beside it, the sampling step alone (sample_batch on the model's vocabulary, 32 rows, grammars
advanced by their own draws): the best of many repetitions, which shared cores disturb least.

    python -m bench sampling_overhead [--streams 32] [--tokens 48] [--reps 3] [--model bench|toy]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

ARMS = {
    "plain": {},
    "logprobs20": {"logprobs": 20},
    "grammar": {"structured": {"json_object": True}},
    "grammar+logprobs20": {"structured": {"json_object": True}, "logprobs": 20},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=48, help="tokens each stream generates per run")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--model", choices=("bench", "toy"), default="bench",
                        help="bench: the 42M engine benchmark model; toy: the tests' tiny model (a smoke run)")
    parser.add_argument("--compile", default="auto", choices=("auto", "on", "off"))
    parser.add_argument("--sampling-reps", type=int, default=200, help="repetitions of the sampling step alone")
    parser.add_argument("--skip-engine", action="store_true", help="measure the sampling step alone")


def _steps(engine: Any, prompts: list[list[int]], tokens: int, extra: dict, tag: str) -> float:
    """Median duration of the steps where every stream decodes."""
    from tandem.contracts.sampling import SamplingParams
    from tandem.testing.engine_helpers import run_to_completion, submit

    steps: list[tuple[float, int]] = []
    engine.on_step = lambda s, n: steps.append((s, n))
    for i, p in enumerate(prompts):
        submit(engine, f"{tag}-{i}", p, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, **extra))
    run_to_completion(engine)
    full = [s for s, n in steps[1:] if n == len(prompts)]
    return statistics.median(full) if full else float("nan")


def _sampling_alone(engine: Any, streams: int, reps: int) -> dict[str, float]:
    """Best-of-`reps` milliseconds of one sampling step per arm: [streams, vocab] float32 logits."""
    import time

    import torch
    from tandem.contracts.sampling import SamplingParams
    from tandem.worker.engine.sampling import SampleRow, sample_batch

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(streams, engine.vocab_size, generator=gen) * 3
    argmax = logits.argmax(-1)
    best: dict[str, float] = {}
    for name, extra in ARMS.items():
        params = SamplingParams(max_tokens=10_000, temperature=0, **extra)
        grammars = [engine.grammars.compile(extra["structured"]) if "structured" in extra else None
                    for _ in range(streams)]
        times = []
        for _ in range(reps):
            rows = [SampleRow(params, 0, 0, grammar=g) for g in grammars]
            t0 = time.perf_counter()
            tokens, _ = sample_batch(logits, rows, argmax)
            times.append(time.perf_counter() - t0)
            for g, t in zip(grammars, tokens, strict=True):
                if g is not None and g.accept(t):  # a finished grammar starts over
                    g.matcher.reset()
        best[name] = min(times) * 1e3
        print(f"sampling alone {name:20s} best {best[name]:7.3f} ms (median {statistics.median(times) * 1e3:.3f})",
              flush=True)
    return best


def _model(kind: str) -> Any:
    if kind == "toy":
        import tempfile
        from pathlib import Path

        from tandem.worker.local.toy_model import make_toy_model

        return make_toy_model(Path(tempfile.gettempdir()) / "tandem-bench-toy-llama")
    from bench.lib.models import engine_model_dir

    return engine_model_dir()


def run(args: argparse.Namespace) -> dict:
    import torch
    from tandem.worker.engine.config import EngineConfig
    from tandem.worker.engine.engine import Engine

    torch.set_num_threads(1)
    model_dir = _model(args.model)
    engine = Engine(EngineConfig(model=str(model_dir), num_blocks=args.streams * ((args.prompt_len + args.tokens)
                                                                                 // 16 + 2) + 8,
                                 max_num_seqs=args.streams, max_batched_tokens=args.streams * args.prompt_len,
                                 compile=args.compile))
    vocab = engine.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, min(vocab, 600), (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.streams)]
    alone = _sampling_alone(engine, args.streams, args.sampling_reps)
    if args.skip_engine:
        return {"streams": args.streams, "vocab": vocab, "model": args.model, "sampling_alone_best_ms": alone}
    for name, extra in ARMS.items():  # warm every path once
        _steps(engine, prompts[:2], 4, extra, f"warm-{name}")
    times: dict[str, list[float]] = {name: [] for name in ARMS}
    for rep in range(args.reps):
        order = list(ARMS) if rep % 2 == 0 else list(reversed(ARMS))
        for name in order:
            times[name].append(_steps(engine, prompts, args.tokens, ARMS[name], f"{name}-{rep}"))
    plain = statistics.median(times["plain"])
    summary = {name: {"step_ms": [t * 1e3 for t in ts], "median_step_ms": statistics.median(ts) * 1e3,
                      "extra_ms_per_step": (statistics.median(ts) - plain) * 1e3,
                      "ratio_to_plain": statistics.median(ts) / plain}
               for name, ts in times.items()}
    for name, s in summary.items():
        print(f"{name:20s} step {s['median_step_ms']:7.2f} ms  (+{s['extra_ms_per_step']:6.2f} ms, "
              f"x{s['ratio_to_plain']:.2f})  reps {' '.join(f'{t:.2f}' for t in s['step_ms'])}", flush=True)
    return {"streams": args.streams, "tokens": args.tokens, "prompt_len": args.prompt_len, "vocab": vocab,
            "model": args.model, "compile": args.compile, "arms": summary, "sampling_alone_best_ms": alone}
