"""What one worker can do, as measured: prefill time per prompt, decode step time per batch size.

The figures come from a calibration file (`tandem plan --model DIR --save-calibration FILE`: Tandem's engine
in-process, pinned threads). Decode steps are
interpolated between the measured batch sizes and extended past the largest with the last slope;
where a smaller batch measured slower than a bigger one (others' load on a shared machine only ever
adds time, never removes it) the smaller takes the bigger one's time. A step that carries a prompt
chunk beside decoding sequences is taken to cost the decode step plus the chunk's own prefill time.
"""

from __future__ import annotations

import bisect
import functools
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Capacity:
    prefill_overhead_s: float  # per prompt (per step)
    prefill_tokens_per_s: float
    decode_batches: tuple[int, ...]  # measured batch sizes, ascending
    decode_step_s: tuple[float, ...]  # step time at each, non-decreasing
    max_seqs: int = 32  # running sequences one decode replica admits (engine max_num_seqs)
    handoff_s: float = 0.01  # KV pull from prefill to decode (BENCHMARKS.md: 2-18 ms per request)
    migrate_s: float = 0.02  # a running sequence moved decode -> decode when its pod is removed
    startup_s: float = 60.0  # a new pod: scheduled, started, model loaded, ready (assumed, not measured)

    def prefill_s(self, prompt_tokens: float) -> float:
        return self.prefill_overhead_s + prompt_tokens / self.prefill_tokens_per_s

    def chunk_step_s(self, n: int, chunk_tokens: float) -> float:
        """One step that prefills `chunk_tokens` of a prompt beside n decoding sequences (n >= 0)."""
        return (self.step_s(n) if n > 0 else 0.0) + self.prefill_s(chunk_tokens)

    @functools.lru_cache(maxsize=1024)  # noqa: B019 (a few frozen instances live for the whole run)
    def step_s(self, n: int) -> float:
        """Seconds of one decode step with n sequences running (n >= 1)."""
        b, s = self.decode_batches, self.decode_step_s
        if n <= b[0]:
            return s[0]
        i = bisect.bisect_left(b, n)
        if i < len(b) and b[i] == n:
            return s[i]
        lo = min(i, len(b) - 1) - 1
        slope = (s[lo + 1] - s[lo]) / (b[lo + 1] - b[lo])
        return s[lo] + slope * (n - b[lo])

    def seats_within(self, itl_s: float) -> int:
        """Most sequences one decode replica runs with its step time within itl_s (at least 1)."""
        n = 1
        while n < self.max_seqs and self.step_s(n + 1) <= itl_s:
            n += 1
        return n

    @classmethod
    def from_calibration(cls, path: Path, **overrides) -> Capacity:
        return cls.from_dict(json.loads(Path(path).read_text()), **overrides)

    @classmethod
    def from_dict(cls, d: dict, **overrides) -> Capacity:
        """From a calibration (prefill_seconds, decode_step_seconds and their fit)."""
        steps = sorted((int(k), float(v)) for k, v in d["decode_step_seconds"].items())
        if not steps:
            raise ValueError("the calibration holds no decode step times (decode_step_seconds is empty)")
        mono, low = [], float("inf")
        for _, v in reversed(steps):  # a step is no slower than one with more sequences
            low = min(low, v)
            mono.append(low)
        mono.reverse()
        fit = d["fit"]
        kw = dict(prefill_overhead_s=max(0.0, fit["prefill_overhead_s"]),
                  prefill_tokens_per_s=fit["prefill_tokens_per_s"],
                  decode_batches=tuple(b for b, _ in steps), decode_step_s=tuple(mono),
                  max_seqs=max(b for b, _ in steps))
        return cls(**{**kw, **overrides})
