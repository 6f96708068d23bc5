"""CPU accounting over a run: the whole machine's busy time (the cores are shared with others) and a
process's event loop against its other threads."""

from __future__ import annotations

import psutil


def busy_cpu_seconds() -> float:
    """Non-idle CPU seconds of the whole machine so far (every core)."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def thread_cpu_delta(pid: int, before: dict[int, float], after: dict[int, float]) -> dict[str, float]:
    """Over a run, from two per-thread readings (BenchProcess.thread_cpu): the main thread's CPU
    seconds (the event loop), the busiest other thread's (a worker's engine thread), the process's."""
    d = {tid: t - before.get(tid, 0.0) for tid, t in after.items()}
    loop = d.pop(pid, 0.0)
    return {"loop": loop, "other_max": max(d.values(), default=0.0), "total": loop + sum(d.values())}
