"""Where a worker's time goes, from a py-spy raw profile (bench/lib/pyspy.py writes them): samples
per thread, and the engine thread's samples by what the innermost Tandem-relevant frame was doing.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

# First match wins, searching each stack from its innermost frame outwards.
ENGINE_RULES: list[tuple[str, str]] = [
    ("matmuls (oneDNN)", r"^packed_linear \(|^Linear\.forward|^PackedLinear\.forward"),
    ("decode attention (eager path)", r"^(paged|sdpa)_decode_attention \("),
    ("prefill attention", r"^(chunk_attention|gather_context) \("),
    ("norms, rotary, activations, residuals (eager)", r"^(rms_norm|rope|qkv|finish|logits) \(.*layers\.py"),
    ("compiled decode graph: fused kernels", r"torchinductor|CompiledFxGraph|^call \("),
    ("compiled graph entry (guards, wrappers)", r"eval_frame\.py|_dynamo|aot_autograd|_inductor"),
    ("pool writes, step set-up", r"^PagedForward\.(forward|_eager) \("),
    ("index tensors", r"^step_inputs \("),
    ("sampling", r"sampling\.py"),
    ("detokenize, stop checks", r"detokenizer\.py"),
    ("waking the event loop (per output)", r"call_soon_threadsafe|_write_to_self"),
    ("scheduling, bookkeeping", r"scheduler\.py|engine\.py|sequence\.py|async_engine\.py"),
]
# The engine before this work (commit 9fdebca) ran every layer inline in one function of
# paged_forward.py, so its time is told apart by line (`--before-9fdebca`).
BEFORE_9FDEBCA_RULES: list[tuple[str, str]] = [
    ("matmuls (q/k/v/o, MLP, output head)", r"^Linear\.forward|^LlamaMLP"),
    ("decode attention: SDPA with a mask", r"paged_forward\.py:13[23]\)"),
    ("decode attention: gather a padded KV copy", r"paged_forward\.py:127\)"),
    ("decode attention: reshapes and indexing", r"paged_forward\.py:1(28|29|30|31|34)\)"),
    ("prefill attention", r"paged_forward\.py:1(3[5-9]|4[0-6])\)"),
    ("norms, rotary", r"LlamaRMSNorm|apply_rotary|rotary|paged_forward\.py:11[23]\)"),
    ("pool writes, step set-up", r"paged_forward\.py:(12[3-5]|1[01]\d|[6-9]\d)\)"),
    ("sampling", r"sampling\.py"),
    ("detokenize, stop checks", r"detokenizer\.py"),
    ("waking the event loop (per output)", r"call_soon_threadsafe|_write_to_self"),
    ("scheduling, bookkeeping", r"scheduler\.py|engine\.py|sequence\.py|async_engine\.py"),
]
LOOP_IDLE = r"\.select \(selectors\.py"


def parse(path: Path) -> list[tuple[str, list[str], int]]:
    """(thread name, frames outermost first, samples) per line of a raw py-spy file."""
    out = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        stack, count = line.rsplit(" ", 1)
        thread, *frames = stack.split(";")
        out.append((thread.split(": ", 1)[-1], frames, int(count)))
    return out


def engine_category(frames: list[str], rules: list[tuple[str, str]] = ENGINE_RULES) -> str:
    for frame in reversed(frames):
        for name, rx in rules:
            if re.search(rx, frame):
                return name
    return "other"


def summarize(path: Path, rules: list[tuple[str, str]] = ENGINE_RULES) -> dict:
    threads: Counter[str] = Counter()
    engine: Counter[str] = Counter()
    for thread, frames, n in parse(path):
        if thread == "tandem-engine":
            threads["engine thread"] += n
            engine[engine_category(frames, rules)] += n
        elif thread == "MainThread":
            idle = frames and re.search(LOOP_IDLE, frames[-1])
            threads["HTTP event loop: waiting" if idle else "HTTP event loop: working"] += n
        else:
            threads[f"other ({thread})"] += n
    total, eng = sum(threads.values()), sum(engine.values())
    return {"samples": total,
            "threads": {k: v / total for k, v in threads.most_common()},
            "engine": {k: v / eng for k, v in engine.most_common()} if eng else {}}
