"""Prometheus metrics of one worker: gauges read from the engine at scrape time, a step histogram.

Each server gets its own registry, so several workers can live in one process (tests) and no
metric carries a per-request label.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from tandem.worker.kv.health import KVTransferMetrics


def _model_server_protocol(eng: Any) -> Iterator[Any]:
    """What the Gateway API Inference Extension's model-server protocol asks of a model server beyond
    its queue (tandem_worker_waiting_sequences, TotalQueuedRequests) and its running requests
    (tandem_worker_running_sequences, TotalRunningRequests): KVCacheUtilization as one gauge, and the
    block size as a label (docs/gateway.md names them for an endpoint picker's flags)."""
    total = eng.allocator.num_blocks
    yield GaugeMetricFamily("tandem_worker_kv_cache_usage_perc", "KV cache usage, 0 to 1 (blocks in use / "
                            "blocks): the model-server protocol's KVCacheUtilization, as vLLM's kv_cache_usage_perc",
                            value=eng.allocator.num_used / total if total else 0.0)
    info = GaugeMetricFamily("tandem_worker_cache_config_info", "The KV cache's configuration, in its labels "
                             "(the model-server protocol's BlockSize)", labels=["block_size", "num_blocks", "cache_dtype"])
    info.add_metric([str(eng.layout.block_size), str(total), str(eng.layout.dtype)], 1)
    yield info


class EngineCollector(Collector):
    def __init__(self, get_engine: Callable[[], Any], get_problem: Callable[[], str | None] = lambda: None):
        self.get_engine = get_engine  # returns the Engine, or None while the model loads
        self.get_problem = get_problem  # why the engine thread cannot serve (died, stalled), or None

    def collect(self) -> Iterator[Any]:
        eng = self.get_engine()
        if eng is None:
            return
        yield GaugeMetricFamily("tandem_worker_engine_healthy", "1 while the engine thread is alive and making "
                                "progress, 0 once it died or stalled (then /health fails)",
                                value=0 if self.get_problem() else 1)
        s = eng.stats
        yield GaugeMetricFamily("tandem_worker_running_sequences", "Sequences in the running batch", value=eng.num_running)
        yield GaugeMetricFamily("tandem_worker_waiting_sequences", "Sequences queued", value=eng.num_waiting)
        yield GaugeMetricFamily("tandem_worker_leased_sequences", "Prefilled sequences whose KV awaits a pull",
                                value=len(eng.leases))
        yield GaugeMetricFamily("tandem_worker_outstanding_prompt_tokens",
                                "Prompt tokens admitted and not yet prefilled (queued or part-way)",
                                value=eng.outstanding_prompt_tokens())
        yield GaugeMetricFamily("tandem_worker_kv_blocks_used", "KV pool blocks in use (cached blocks nobody "
                                "holds are free)", value=eng.allocator.num_used)
        yield GaugeMetricFamily("tandem_worker_kv_blocks_total", "KV pool blocks", value=eng.allocator.num_blocks)
        yield GaugeMetricFamily("tandem_worker_kv_block_size_tokens", "Tokens per KV block", value=eng.layout.block_size)
        yield from _model_server_protocol(eng)
        yield CounterMetricFamily("tandem_worker_prompt_tokens", "Prompt tokens admitted", value=s.prompt_tokens_total)
        yield CounterMetricFamily("tandem_worker_generation_tokens", "Tokens generated", value=s.generation_tokens_total)
        yield CounterMetricFamily("tandem_worker_preemptions", "Sequences preempted for recompute",
                                  value=s.preemptions_total)
        yield CounterMetricFamily("tandem_worker_steps", "Engine forward steps", value=s.steps_total)
        yield CounterMetricFamily("tandem_worker_prefill_tokens_computed", "Tokens run through the model "
                                  "other than one per decode step: prompts prefilled here, sequences recomputed",
                                  value=s.prefill_tokens_computed_total)
        out = CounterMetricFamily("tandem_worker_migrations_out", "Sequences a draining worker handed to other "
                                  "workers: kv (their KV leased for the pull) or recompute (none yet)",
                                  labels=["how"])
        for how in ("kv", "recompute"):
            out.add_metric([how], s.migrated_out.get(how, 0))
        yield out
        yield from _prefix_cache(eng)
        yield from _compiles()
        fin = CounterMetricFamily("tandem_worker_requests_finished", "Finished sequences by reason",
                                  labels=["finish_reason"])
        for reason, n in sorted(s.requests_finished.items()):
            fin.add_metric([reason], n)
        yield fin


def _prefix_cache(eng: Any) -> Iterator[Any]:
    """Prefix-cache lookups and hits in tokens, what it holds, what it evicted (nothing for an
    engine without a prefix cache)."""
    pc, alloc = getattr(eng, "prefix_cache", None), eng.allocator
    if pc is None:
        return
    yield CounterMetricFamily("tandem_worker_prefix_cache_query_tokens", "Tokens of the sequences that "
                              "looked up a cached prefix (prompts computed here, prompts pulled)",
                              value=pc.stats.query_tokens_total)
    yield CounterMetricFamily("tandem_worker_prefix_cache_hit_tokens", "Of those, tokens found cached "
                              "(not computed, not pulled)", value=pc.stats.hit_tokens_total)
    yield GaugeMetricFamily("tandem_worker_prefix_cache_blocks", "KV blocks named in the prefix cache, "
                            "in use or not", value=alloc.num_cached)
    yield GaugeMetricFamily("tandem_worker_prefix_cache_evictable_blocks", "Cached KV blocks no sequence "
                            "holds (counted free: a new allocation evicts them)", value=alloc.num_cached_free)
    yield CounterMetricFamily("tandem_worker_prefix_cache_evictions", "Cached KV blocks evicted for reuse",
                              value=alloc.evictions_total)


class WorkerMetrics:
    def __init__(self, get_engine: Callable[[], Any], get_problem: Callable[[], str | None] = lambda: None):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(get_engine, get_problem))
        self.kv_transfer = KVTransferMetrics(self.registry)  # for the KV transport (config.extra["kv_metrics"])
        self.refused = Counter(
            "tandem_worker_requests_refused", "Requests refused because the worker was full, by reason "
            "(queue_full, kv_cache_full, prefill_queue_timeout); answered 429/503 with Retry-After",
            ["reason"], registry=self.registry,
        )
        self.step_seconds = Histogram(
            "tandem_worker_step_seconds", "Duration of one engine step (forward + sampling)",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12),
            registry=self.registry,
        )
        self.step_gap_seconds = Histogram(
            "tandem_worker_step_gap_seconds", "Time between two engine steps while there was work "
            "(the engine loop, its locks, waiting for the GIL while the HTTP side runs)",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16),
            registry=self.registry,
        )
        self.step_tokens = Histogram(
            "tandem_worker_step_tokens", "Tokens processed in one engine step",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192), registry=self.registry,
        )
        self.kv_pull_seconds = Histogram(
            "tandem_worker_kv_pull_seconds", "Time to pull a handoff's KV from a prefill worker (or a "
            "migrated sequence's from a draining decode worker)",
            registry=self.registry,
        )
        self.kv_pull_saved_bytes = Counter(
            "tandem_worker_kv_pull_saved_bytes", "KV bytes a handoff did not move: the prompt's leading "
            "blocks this worker's prefix cache already held", registry=self.registry,
        )
        self.migrations_in = Counter(
            "tandem_worker_migrations_in", "Sequences migrated here from a draining decode worker with "
            "their KV (pulled, or found in this worker's prefix cache)", registry=self.registry,
        )
        self.migration_pulled_tokens = Counter(
            "tandem_worker_migration_pulled_tokens", "Tokens whose KV was pulled from a draining decode "
            "worker for the sequences migrated here (not recomputed)", registry=self.registry,
        )

        self.kv_verify = {v: Counter(name, doc, registry=self.registry) for v, name, doc in (
            ("verified", "tandem_kv_transfer_verified", "KV pulls whose every block matched the source's digests"),
            ("failed", "tandem_kv_transfer_verify_failures", "KV pulls whose block count or a block's digest "
             "differed from the source's: never served, the prompt prefilled here instead"),
            ("skipped", "tandem_kv_transfer_verify_skipped", "KV pulls that could not be verified (tensor "
             "parallelism, or a source without digests: the log says why, once)"))}
        self.kv_verify_seconds = Histogram(
            "tandem_kv_transfer_verify_seconds", "Time to digest the blocks one pull wrote and compare them",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25),
            registry=self.registry,
        )

    def observe_step(self, seconds: float, num_tokens: int) -> None:
        self.step_seconds.observe(seconds)
        self.step_tokens.observe(num_tokens)

    def observe_pull(self, report: Any) -> None:
        """One handoff's KV pulled (engine/kv_pull.py PullReport)."""
        self.kv_pull_seconds.observe(report.seconds)
        self.kv_pull_saved_bytes.inc(report.saved_bytes)
        if report.migrated_from is not None:
            self.migrations_in.inc()
            self.migration_pulled_tokens.inc(report.pulled_tokens)

    def observe_verify(self, verdict: Any, seconds: float) -> None:
        """One pull's verdict (worker/kv/verify.py Verdict, never OFF here) and the time it took."""
        self.kv_verify[str(verdict)].inc()
        self.kv_verify_seconds.observe(seconds)


def _compiles() -> Iterator[Any]:
    """The process's compiles (compile_cache.RECORD): an eager fallback is never silent."""
    from tandem.worker.engine.compile_cache import RECORD

    yield CounterMetricFamily("tandem_worker_compile_failures", "Compiles of the decode step that failed and "
                              "left it eager (slower); the worker log says why", value=RECORD.failures)
    yield CounterMetricFamily("tandem_worker_compile_cache_repairs", "Broken object files (left by a compile "
                              "that did not finish) removed from the inductor cache and built again",
                              value=RECORD.objects_removed)
