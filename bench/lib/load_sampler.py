"""The machine's load average sampled through a whole run, so every result says how busy the
shared cores were while it was measured (the end's 1/5/15-minute averages alone miss a burst)."""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable


def summarize_load(samples: list[tuple[float, float]]) -> dict[str, float | int | None]:
    """min, median and max of the 1-minute load average over (seconds since start, load) samples."""
    loads = [load for _, load in samples]
    if not loads:
        return {"samples": 0, "min": None, "median": None, "max": None}
    return {"samples": len(loads), "min": round(min(loads), 2), "median": round(statistics.median(loads), 2),
            "max": round(max(loads), 2)}


def load_phrase(summary: dict | None) -> str:
    """'load average 1.2-3.4 (median 2.0)' for a table's caption; '' when nothing was sampled."""
    if not summary or not summary.get("samples"):
        return ""
    return f"load average {summary['min']:.1f}-{summary['max']:.1f} (median {summary['median']:.1f})"


class LoadSampler:
    """Samples os.getloadavg()[0] every `every_s` seconds on a daemon thread until stop()."""

    def __init__(self, every_s: float = 10.0, read: Callable[[], tuple[float, float, float]] = os.getloadavg):
        self.every_s, self._read = every_s, read
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="load-sampler", daemon=True)

    def _loop(self) -> None:
        while True:
            self.samples.append((round(time.monotonic() - self._t0, 1), self._read()[0]))
            if self._stop.wait(self.every_s):
                return

    def start(self) -> LoadSampler:
        self._thread.start()
        return self

    def summary(self) -> dict[str, float | int | None]:
        return summarize_load(list(self.samples))

    def stop(self) -> dict:
        """The summary and every sample (the last taken now)."""
        self._stop.set()
        self._thread.join(timeout=5)
        self.samples.append((round(time.monotonic() - self._t0, 1), self._read()[0]))
        return {**self.summary(), "every_s": self.every_s, "series": list(self.samples)}
