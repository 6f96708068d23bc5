"""One process's /metrics text -> typed cumulative readings, with prometheus_client's own parser.

A reading is what one scrape saw (counters and histograms since the process started, gauges now);
snapshot.py turns two readings into rates and windowed percentiles. A text that lacks what the
planner needs raises UnreadableMetrics naming the missing series, so "no data" is never read as 0.

A worker is Tandem's engine (tandem_worker_*) or a vLLM server (vllm:*, runtime vllm), told apart by
what its page exports. vLLM's series map onto the same reading: requests running and waiting, KV
usage times its block count (`vllm:cache_config_info`'s num_gpu_blocks), prompt and generated tokens,
engine steps and their tokens (`vllm:iteration_tokens_total`). vLLM exports no time spent stepping;
its stand-in is the time its requests spent being prefilled (`vllm:request_prefill_time_seconds`),
which is a prefill server's busy time while it computes one prompt at a time and more than it when
it batches several prompts into one step (the planner then errs towards more prefill pods). vLLM
keeps no lease count and no prompt backlog in tokens: those read 0 and unknown.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

TTFT = "tandem_time_to_first_token_seconds"
ITL = "tandem_inter_token_latency_seconds"
IN_FLIGHT = "tandem_requests_in_flight"
REQUESTS = "tandem_requests_total"
ROUTES = "tandem_router_routes_total"

RUNNING = "tandem_worker_running_sequences"
WAITING = "tandem_worker_waiting_sequences"
LEASED = "tandem_worker_leased_sequences"
KV_USED = "tandem_worker_kv_blocks_used"
KV_TOTAL = "tandem_worker_kv_blocks_total"
PROMPT_TOKENS = "tandem_worker_prompt_tokens_total"
GENERATION_TOKENS = "tandem_worker_generation_tokens_total"
STEP_SECONDS = "tandem_worker_step_seconds"
STEP_TOKENS = "tandem_worker_step_tokens"
# Not exported by every worker version: the planner then goes without the prefill backlog.
OUTSTANDING_PROMPT_TOKENS = "tandem_worker_outstanding_prompt_tokens"

VLLM_RUNNING = "vllm:num_requests_running"
VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_KV_USAGE = "vllm:kv_cache_usage_perc"  # 0..1
VLLM_CACHE_INFO = "vllm:cache_config_info"  # labels: num_gpu_blocks, block_size, ...
VLLM_PROMPT_TOKENS = "vllm:prompt_tokens_total"
VLLM_GENERATION_TOKENS = "vllm:generation_tokens_total"
VLLM_STEP_TOKENS = "vllm:iteration_tokens_total"  # a histogram: one observation per engine step
VLLM_PREFILL_SECONDS = "vllm:request_prefill_time_seconds"  # a histogram: one observation per request
VLLM_REQUIRED = (VLLM_RUNNING, VLLM_WAITING, VLLM_KV_USAGE, VLLM_PROMPT_TOKENS, VLLM_GENERATION_TOKENS,
                 f"{VLLM_STEP_TOKENS}_sum", f"{VLLM_STEP_TOKENS}_count", f"{VLLM_PREFILL_SECONDS}_sum")

WORKER_REQUIRED = (RUNNING, WAITING, LEASED, KV_USED, KV_TOTAL, PROMPT_TOKENS, GENERATION_TOKENS,
                   f"{STEP_SECONDS}_sum", f"{STEP_SECONDS}_count", f"{STEP_TOKENS}_sum")


class UnreadableMetrics(ValueError):
    """The text is not Prometheus exposition, or lacks a series the planner needs."""


@dataclass(frozen=True)
class Histogram:
    """A Prometheus histogram: cumulative counts per upper bound (the last bound is +Inf)."""

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]
    sum: float = 0.0

    @classmethod
    def empty(cls, bounds: Iterable[float]) -> Histogram:
        b = tuple(sorted(set(bounds) | {math.inf}))
        return cls(b, (0.0,) * len(b), 0.0)

    @property
    def count(self) -> float:
        return self.cumulative[-1] if self.cumulative else 0.0

    def since(self, older: Histogram | None) -> Histogram:
        """What was observed after `older` (all of self when the process restarted in between)."""
        if older is None or older.bounds != self.bounds:
            return self
        diff = tuple(a - b for a, b in zip(self.cumulative, older.cumulative, strict=True))
        if any(d < 0 for d in diff):
            return self  # a counter went down: the process restarted
        return Histogram(self.bounds, diff, self.sum - older.sum)

    def plus(self, other: Histogram) -> Histogram:
        """Two processes' histograms with the same buckets, added (several router replicas)."""
        if other.bounds != self.bounds:
            raise UnreadableMetrics(f"histogram buckets differ: {self.bounds} vs {other.bounds}")
        return Histogram(self.bounds, tuple(a + b for a, b in zip(self.cumulative, other.cumulative, strict=True)),
                         self.sum + other.sum)

    def quantile(self, q: float) -> float | None:
        """histogram_quantile's estimate (linear within a bucket); None when nothing was observed.

        An estimate in the +Inf bucket is reported as the highest finite bound, as Prometheus does.
        """
        total = self.count
        if total <= 0:
            return None
        rank = q * total
        i = bisect.bisect_left(self.cumulative, rank)
        i = min(i, len(self.bounds) - 1)
        if math.isinf(self.bounds[i]):
            finite = [b for b in self.bounds if not math.isinf(b)]
            return finite[-1] if finite else None
        lo = self.bounds[i - 1] if i > 0 else 0.0
        below = self.cumulative[i - 1] if i > 0 else 0.0
        in_bucket = self.cumulative[i] - below
        if in_bucket <= 0:
            return self.bounds[i]
        return lo + (self.bounds[i] - lo) * (rank - below) / in_bucket

    def bucket_floor(self, q: float) -> float | None:
        """The lower edge of the bucket the q-quantile falls in: the quantile is surely above it."""
        total = self.count
        if total <= 0:
            return None
        i = min(bisect.bisect_left(self.cumulative, q * total), len(self.bounds) - 1)
        return self.bounds[i - 1] if i > 0 else 0.0

    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None


@dataclass(frozen=True)
class RouterReading:
    """One router process's /metrics."""

    ttft: Histogram
    itl: Histogram
    in_flight: float
    requests: float  # requests answered, every outcome
    routes: dict[str, float] = field(default_factory=dict)  # route reason -> requests


@dataclass(frozen=True)
class WorkerReading:
    """One worker process's /metrics (engine gauges now, counters since it started)."""

    running: float
    waiting: float
    leased: float
    kv_blocks_used: float
    kv_blocks_total: float
    prompt_tokens: float
    generation_tokens: float
    busy_seconds: float  # time spent in engine steps
    steps: float
    step_tokens: float  # tokens processed by those steps
    outstanding_prompt_tokens: float | None = None  # None: this worker does not export it


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _samples(text: str) -> Samples:
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, TypeError, IndexError) as e:
        raise UnreadableMetrics(f"not Prometheus text: {e}") from e
    out: Samples = {}
    for fam in families:
        for s in fam.samples:
            if s.name.endswith("_created") or (isinstance(s.value, float) and math.isnan(s.value)):
                continue
            key = (s.name, tuple(sorted(s.labels.items())))
            out[key] = out.get(key, 0.0) + float(s.value)
    return out


def _total(samples: Samples, name: str) -> float | None:
    """A series summed over its label sets (`le` excluded by the caller); None when absent."""
    values = [v for (n, _), v in samples.items() if n == name]
    return sum(values) if values else None


def _histogram(samples: Samples, name: str) -> Histogram | None:
    by_le: dict[float, float] = {}
    for (n, labels), v in samples.items():
        if n == f"{name}_bucket":
            le = dict(labels).get("le")
            if le is not None:
                bound = float(le)
                by_le[bound] = by_le.get(bound, 0.0) + v
    if not by_le:
        return None
    bounds = tuple(sorted(by_le))
    return Histogram(bounds, tuple(by_le[b] for b in bounds), _total(samples, f"{name}_sum") or 0.0)


def parse_router(text: str) -> RouterReading:
    """A router's /metrics -> RouterReading; UnreadableMetrics names what is missing."""
    s = _samples(text)
    ttft, itl = _histogram(s, TTFT), _histogram(s, ITL)
    in_flight, requests = _total(s, IN_FLIGHT), _total(s, REQUESTS)
    missing = [n for n, v in ((TTFT, ttft), (ITL, itl), (IN_FLIGHT, in_flight)) if v is None]
    if missing:
        raise UnreadableMetrics("router metrics lack " + ", ".join(missing))
    routes: dict[str, float] = {}
    for (n, labels), v in s.items():
        if n == ROUTES:
            route = dict(labels).get("route", "")
            routes[route] = routes.get(route, 0.0) + v
    return RouterReading(ttft=ttft, itl=itl, in_flight=in_flight, requests=requests or 0.0,  # type: ignore[arg-type]
                         routes=routes)


def parse_worker(text: str) -> WorkerReading:
    """A worker's /metrics -> WorkerReading; UnreadableMetrics names what is missing.

    A worker still loading its model exports no engine series: that reads as unreadable, not as idle.
    """
    s = _samples(text)
    if _total(s, VLLM_RUNNING) is not None:
        return _vllm_reading(s)
    values = {n: _total(s, n) for n in WORKER_REQUIRED}
    missing = [n for n, v in values.items() if v is None]
    if missing:
        raise UnreadableMetrics("worker metrics lack " + ", ".join(missing)
                                + (" (the model may still be loading)" if RUNNING in missing else ""))
    v: dict[str, float] = values  # type: ignore[assignment]
    return WorkerReading(
        running=v[RUNNING], waiting=v[WAITING], leased=v[LEASED], kv_blocks_used=v[KV_USED],
        kv_blocks_total=v[KV_TOTAL], prompt_tokens=v[PROMPT_TOKENS], generation_tokens=v[GENERATION_TOKENS],
        busy_seconds=v[f"{STEP_SECONDS}_sum"], steps=v[f"{STEP_SECONDS}_count"],
        step_tokens=v[f"{STEP_TOKENS}_sum"], outstanding_prompt_tokens=_total(s, OUTSTANDING_PROMPT_TOKENS),
    )


def _vllm_reading(s: Samples) -> WorkerReading:
    """A vLLM server's series as a WorkerReading (see the module docstring for what stands in for what)."""
    values = {n: _total(s, n) for n in VLLM_REQUIRED}
    missing = [n for n, v in values.items() if v is None]
    if missing:
        raise UnreadableMetrics("vLLM metrics lack " + ", ".join(missing))
    v: dict[str, float] = values  # type: ignore[assignment]
    blocks = _num_gpu_blocks(s)
    usage = min(1.0, max(0.0, v[VLLM_KV_USAGE]))
    return WorkerReading(
        running=v[VLLM_RUNNING], waiting=v[VLLM_WAITING], leased=0.0,
        kv_blocks_used=usage * blocks, kv_blocks_total=blocks,
        prompt_tokens=v[VLLM_PROMPT_TOKENS], generation_tokens=v[VLLM_GENERATION_TOKENS],
        busy_seconds=v[f"{VLLM_PREFILL_SECONDS}_sum"], steps=v[f"{VLLM_STEP_TOKENS}_count"],
        step_tokens=v[f"{VLLM_STEP_TOKENS}_sum"], outstanding_prompt_tokens=None,
    )


def _num_gpu_blocks(s: Samples) -> float:
    """The KV cache's blocks from vllm:cache_config_info's label (1: usage read as a fraction when a
    server does not say; a sum of such pods is then a mean, as the planner's KV ratio needs)."""
    for (name, labels), _ in s.items():
        if name == VLLM_CACHE_INFO:
            try:
                blocks = float(dict(labels).get("num_gpu_blocks", ""))
            except ValueError:
                continue
            if blocks > 0:
                return blocks
    return 1.0
