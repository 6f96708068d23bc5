"""What one benchmark run measured, and the statistics drawn from it.

Pure functions only (no I/O, no clock): they are unit-tested in tests/bench/. Definitions follow
`vllm bench serve`: TTFT is send to first token at the client; TPOT per request is
(e2e - ttft) / (output_tokens - 1); ITL pools every inter-token gap of every request (the
interference metric).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

QUANTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """One request as the load generator saw it. Times are seconds since the run started."""

    index: int  # position in the workload's request list: the same prompt in every arm
    prompt_tokens_target: int
    max_tokens: int
    scheduled_s: float = 0.0  # intended send time (open loop); 0 in closed loop
    send_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)  # arrival of every streamed text chunk
    end_s: float | None = None
    prompt_tokens: int | None = None  # usage, as the server counted them
    completion_tokens: int | None = None
    text: str = ""
    error: str | None = None
    finish_reason: str | None = None  # the last choice's finish_reason, as streamed
    done: bool = False  # the stream ended with `data: [DONE]` (not just a closed body)
    timed_out: bool = False  # the server went silent past the client's read (or total) timeout

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_s is not None and bool(self.chunk_times_s)

    @property
    def ttft(self) -> float | None:
        if not self.ok or self.send_s is None:
            return None
        return self.chunk_times_s[0] - self.send_s

    @property
    def e2e(self) -> float | None:
        if not self.ok or self.send_s is None or self.end_s is None:
            return None
        return self.end_s - self.send_s

    @property
    def gaps(self) -> list[float]:
        """Every inter-token gap (between consecutive streamed chunks) of this request."""
        if not self.ok:
            return []
        t = self.chunk_times_s
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def output_tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else len(self.chunk_times_s)

    @property
    def tpot(self) -> float | None:
        ttft, e2e, n = self.ttft, self.e2e, self.output_tokens
        if ttft is None or e2e is None or n < 2:
            return None
        return (e2e - ttft) / (n - 1)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestRecord:
        return cls(**d)


def percentile(values: Iterable[float], q: float) -> float:
    """The bench's one percentile: linear interpolation between the two nearest ranks, numpy's
    default method, which `vllm bench serve` uses (np.percentile), so a Tandem and a vLLM figure
    mean the same; NaN for no values."""
    values = list(values)
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within [0, 100], got {q}")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def distribution(values: list[float]) -> dict[str, float]:
    """p50/p90/p99/max/mean and the count: the shape every latency is reported in."""
    out: dict[str, float] = {f"p{q}": percentile(values, q) for q in QUANTILES}
    out["max"] = max(values) if values else math.nan
    out["mean"] = statistics.fmean(values) if values else math.nan
    out["n"] = len(values)
    return out


def pooled_itl(records: list[RequestRecord]) -> list[float]:
    """Every inter-token gap of every successful request, in one list."""
    return [g for r in records for g in r.gaps]


def run_duration(records: list[RequestRecord]) -> float:
    """From the first send to the last completion (or error) of the run."""
    sends = [r.send_s for r in records if r.send_s is not None]
    ends = [r.end_s for r in records if r.end_s is not None]
    if not sends or not ends:
        return 0.0
    return max(ends) - min(sends)


def summarize(records: list[RequestRecord]) -> dict[str, Any]:
    """Everything the report shows for one (workload, arm, repetition)."""
    ok = [r for r in records if r.ok]
    duration = run_duration(records)
    out_tokens = sum(r.output_tokens for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [t for r in ok if (t := r.tpot) is not None]
    e2es = [r.e2e for r in ok if r.e2e is not None]
    calib = [r.prompt_tokens - r.prompt_tokens_target for r in ok if r.prompt_tokens is not None]
    return {
        "requests": len(records),
        "completed": len(ok),
        "errors": len(records) - len(ok),
        "duration_s": duration,
        "throughput_rps": len(ok) / duration if duration > 0 else 0.0,
        "output_tokens_per_s": out_tokens / duration if duration > 0 else 0.0,
        "ttft": distribution(ttfts),
        "itl": distribution(pooled_itl(ok)),
        "tpot": distribution(tpots),
        # The gap after the first token: where a handoff lands when the router streams the
        # prefill worker's first token before the decode worker has pulled the KV.
        "first_gap": distribution([r.gaps[0] for r in ok if r.gaps]),
        "e2e": distribution(e2es),
        "output_tokens_mean": statistics.fmean([r.output_tokens for r in ok]) if ok else math.nan,
        # Prompt lengths as the server counted them, against the target the load generator aimed at.
        "prompt_tokens_off_by_max": max((abs(c) for c in calib), default=math.nan),
    }


def text_mismatches(records: list[RequestRecord], reference: dict[int, str]) -> list[int]:
    """Indexes whose streamed text differs from the reference run's (greedy sampling only); an
    index the reference lacks takes this run's text as its reference."""
    bad = [r.index for r in records if r.ok and r.index in reference and r.text != reference[r.index]]
    reference.update({r.index: r.text for r in records if r.ok and r.index not in reference})
    return bad


def ratio(num: float, den: float) -> float:
    if den == 0 or math.isnan(num) or math.isnan(den):
        return math.nan
    return num / den


def spread(values: list[float]) -> dict[str, float]:
    """Median and range over repetitions, ignoring NaNs."""
    v = [x for x in values if not math.isnan(x)]
    if not v:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


def get_path(d: dict[str, Any], path: str) -> float:
    """summary["ttft"]["p99"] as get_path(summary, "ttft.p99"); NaN where absent."""
    cur: Any = d
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return math.nan
        cur = cur[part]
    return float(cur) if isinstance(cur, int | float) else math.nan
