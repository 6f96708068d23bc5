"""Where a process's time goes: py-spy on running processes, the one way a scenario profiles (all
threads, Python frames, raw format, without pausing them), and its samples classified: per thread,
and the engine thread's by what its innermost Tandem-relevant frame was doing."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

NOT_INSTALLED = "py-spy not installed (pip install py-spy, or set $PY_SPY)"


def pyspy_exe() -> str | None:
    """py-spy: $PY_SPY, else beside this interpreter, else on PATH; None when not installed."""
    for cand in (os.environ.get("PY_SPY"), str(Path(sys.executable).with_name("py-spy")), shutil.which("py-spy")):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    return None


def start_pyspy(exe: str, pid: int, out: Path) -> subprocess.Popen:
    """py-spy record on one process into `out`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [exe, "record", "--pid", str(pid), "--rate", "250", "--format", "raw", "--threads",
           "--nonblocking", "--output", str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_pyspy(spy: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGINT makes py-spy write its file; wait for it (blocking: run it in a thread)."""
    spy.send_signal(signal.SIGINT)
    try:
        spy.wait(timeout_s)
    except subprocess.TimeoutExpired:
        spy.kill()
        spy.wait(5)


@asynccontextmanager
async def profiling(targets: dict[int, Path]) -> AsyncIterator[dict[Path, dict]]:
    """py-spy on every pid -> output file for the duration of the block (RuntimeError when py-spy
    is not installed); what it yields holds each file's summary once the block is over."""
    exe = pyspy_exe()
    if exe is None:
        raise RuntimeError(NOT_INSTALLED)
    spies = [start_pyspy(exe, pid, out) for pid, out in targets.items()]
    summaries: dict[Path, dict] = {}
    try:
        await asyncio.sleep(1.0)  # py-spy gives no sign that it attached; a second is plenty
        yield summaries
    finally:
        await asyncio.gather(*(asyncio.to_thread(stop_pyspy, s) for s in spies))
    summaries.update({out: summarize(out) for out in targets.values() if out.is_file()})


# First match wins, searching each stack from its innermost frame outwards.
ENGINE_RULES: list[tuple[str, str]] = [
    ("matmuls (oneDNN)", r"^packed_linear \(|^Linear\.forward|^PackedLinear\.forward"),
    ("decode attention (eager path)", r"^(paged|sdpa)_decode_attention \("),
    ("prefill attention", r"^(chunk_attention|gather_context) \("),
    ("norms, rotary, activations, residuals (eager)", r"transformers/models/"),
    ("compiled decode graph: fused kernels", r"torchinductor|CompiledFxGraph|^call \("),
    ("compiled graph entry (guards, wrappers)", r"eval_frame\.py|_dynamo|aot_autograd|_inductor"),
    ("pool writes, step set-up", r"^(run_decode_graph|paged_attention|TransformersForward\.(forward|_run)) \("),
    ("index tensors", r"^step_inputs \("),
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


def engine_category(frames: list[str]) -> str:
    for frame in reversed(frames):
        for name, rx in ENGINE_RULES:
            if re.search(rx, frame):
                return name
    return "other"


def summarize(path: Path) -> dict:
    """Shares of samples per thread, and of the engine thread's samples by what it was doing."""
    threads: Counter[str] = Counter()
    engine: Counter[str] = Counter()
    for thread, frames, n in parse(path):
        if thread == "tandem-engine":
            threads["engine thread"] += n
            engine[engine_category(frames)] += n
        elif thread == "MainThread":
            idle = frames and re.search(LOOP_IDLE, frames[-1])
            threads["HTTP event loop: waiting" if idle else "HTTP event loop: working"] += n
        else:
            threads[f"other ({thread})"] += n
    total, eng = sum(threads.values()), sum(engine.values())
    return {"samples": total,
            "threads": {k: v / total for k, v in threads.most_common()},
            "engine": {k: v / eng for k, v in engine.most_common()} if eng else {}}

