"""py-spy on running processes: the one way a scenario profiles (all threads, Python frames, raw
format, without pausing them); bench/lib/profile_summary.py reads what it writes."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
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
async def profiling(targets: dict[int, Path]) -> AsyncIterator[None]:
    """py-spy on every pid -> output file for the duration of the block (RuntimeError when py-spy
    is not installed)."""
    exe = pyspy_exe()
    if exe is None:
        raise RuntimeError(NOT_INSTALLED)
    spies = [start_pyspy(exe, pid, out) for pid, out in targets.items()]
    try:
        await asyncio.sleep(1.0)  # py-spy gives no sign that it attached; a second is plenty
        yield
    finally:
        await asyncio.gather(*(asyncio.to_thread(stop_pyspy, s) for s in spies))
