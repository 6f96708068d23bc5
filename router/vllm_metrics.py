"""The router's metrics under the names and labels a vLLM dashboard, an HPA or a KEDA rule reads:
`vllm:` names with a `model_name` label (the served model: one value, as check_model admits no
other). They sit beside Tandem's own `tandem_` series, which say more (routes, handoffs,
migrations, per-role workers); both are documented in router/README.md.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60, float("inf"))
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.2, 0.5, 1, 2.5, float("inf"))
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, float("inf"))
M = ["model_name"]


class VllmMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token (at the router).",
                              M, registry=r, buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Gap between streamed token chunks.",
                             M, registry=r, buckets=_ITL_BUCKETS)
        self.tpot = Histogram("vllm:time_per_output_token_seconds",
                              "Per request: (latency - time to first token) / (output tokens - 1).",
                              M, registry=r, buckets=_ITL_BUCKETS)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency, successful requests.",
                             M, registry=r, buckets=_LATENCY_BUCKETS)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.", M, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens of finished requests.",
                                         M, registry=r)
        self.request_prompt = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", M,
                                        registry=r, buckets=_TOKEN_BUCKETS)
        self.request_generation = Histogram("vllm:request_generation_tokens", "Generated tokens per request.",
                                            M, registry=r, buckets=_TOKEN_BUCKETS)
        self.success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                               M + ["finished_reason"], registry=r)
        self.running = Gauge("vllm:num_requests_running", "Sequences running on the workers (all together).",
                             M, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Sequences queued on the workers (all together).",
                             M, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc",
                              "KV cache usage of the decode-capable workers, 0..1 (their mean).", M, registry=r)

    def finished(self, model: str, reason: str, prompt_tokens: int, completion_tokens: int, e2e_s: float,
                 ttft_s: float | None) -> None:
        """One request served to its end."""
        self.success.labels(model, reason).inc()
        self.prompt_tokens.labels(model).inc(prompt_tokens)
        self.generation_tokens.labels(model).inc(completion_tokens)
        self.request_prompt.labels(model).observe(prompt_tokens)
        self.request_generation.labels(model).observe(completion_tokens)
        self.e2e.labels(model).observe(e2e_s)
        if ttft_s is not None and completion_tokens > 1:
            self.tpot.labels(model).observe((e2e_s - ttft_s) / (completion_tokens - 1))

    def workers(self, model: str | None, views: Iterable) -> None:
        """At scrape time: load summed over the ready workers, KV usage over the decode-capable ones."""
        if not model:
            return
        ready = [v for v in views if v.ready]
        self.running.labels(model).set(sum(v.running for v in ready))
        self.waiting.labels(model).set(sum(v.waiting for v in ready))
        decode = [v.kv_usage for v in ready if v.serves_decode]
        self.kv_usage.labels(model).set(sum(decode) / len(decode) if decode else 0.0)
