"""Prometheus metrics measured at the router, where the client sees latency.

Each router app owns its registry (several can live in one test process). No per-request labels,
and no label that grows as pods come and go: worker series are labelled by role only (which worker
failed is in the log, with its address).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from tandem.router.vllm_metrics import VllmMetrics

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60, float("inf"))
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.2, 0.5, 1, 2.5, float("inf"))


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "tandem_time_to_first_token_seconds",
            "Time from the request's arrival to its first token leaving the router.",
            registry=r, buckets=_LATENCY_BUCKETS,
        )
        self.itl = Histogram(
            "tandem_inter_token_latency_seconds",
            "Gap between consecutive token chunks sent to a client.",
            registry=r, buckets=_ITL_BUCKETS,
        )
        self.e2e = Histogram(
            "tandem_e2e_request_latency_seconds",
            "Time from a request's arrival to its last byte, for successful requests.",
            registry=r, buckets=_LATENCY_BUCKETS,
        )
        self.in_flight = Gauge(
            "tandem_requests_in_flight", "Generation requests being served now.", registry=r
        )
        self.flow_waiting = Gauge(
            "tandem_router_flow_waiting", "Requests waiting at the flow control gate for their turn.", registry=r
        )
        self.flow_wait = Histogram(
            "tandem_router_flow_wait_seconds", "How long a request waited at the flow control gate.",
            registry=r, buckets=_LATENCY_BUCKETS,
        )
        self.flow_refused = Counter(
            "tandem_router_flow_refused",
            "Requests refused by flow control (429): their band was full, or they waited past the TTL.",
            ["reason"], registry=r,
        )
        for reason in ("band_full", "ttl"):
            self.flow_refused.labels(reason)
        # the endpoint picker (picker.py), when the router serves ext_proc
        self.picker_picks = Counter(
            "tandem_router_picker_picks", "Requests the endpoint picker routed, by route reason.", ["route"], registry=r,
        )
        self.picker_refused = Counter(
            "tandem_router_picker_refused",
            "Requests the endpoint picker answered itself (a 4xx, 429 from flow control, 503), by HTTP status.",
            ["status"], registry=r,
        )
        self.picker_served = Counter(
            "tandem_router_picker_served",
            "Responses whose gateway reported the endpoint that served them: followed=true when it is the "
            "one the picker chose.", ["followed"], registry=r,
        )
        self.picker_seconds = Histogram(
            "tandem_router_picker_seconds",
            "From a request's body to the picker's answer: reading, tokenizing, the flow control turn, routing.",
            registry=r, buckets=_LATENCY_BUCKETS,
        )
        self.requests = Counter(
            "tandem_requests",
            "Generation requests by outcome: the HTTP status, 499 for a client that went away, "
            "502 for a stream that broke after it started.",
            ["status"], registry=r,
        )
        self.worker_requests = Counter(
            "tandem_router_worker_requests",
            "Calls the router made to workers (prefill or generate), by role.",
            ["role"], registry=r,
        )
        self.worker_failures = Counter(
            "tandem_router_worker_failures",
            "Calls to workers that failed (unreachable, 5xx, broken stream), by role.",
            ["role"], registry=r,
        )
        self.handoffs_diverged = Counter(
            "tandem_router_handoffs_diverged",
            "Handoffs whose decode worker, given the prefill's KV, regenerated another first token than the "
            "prefill's (vLLM): KV that was not the prompt's; each is recomputed apart. Alert on any.",
            registry=r,
        )
        self.worker_busy = Counter(
            "tandem_router_worker_busy",
            "Calls refused by a full worker (429, or 503 with Retry-After): not failures.",
            ["role"], registry=r,
        )
        self.routes = Counter(
            "tandem_router_routes",
            "How requests were routed: disaggregated, or straight to decode and why.",
            ["route"], registry=r,
        )
        self.resumes = Counter(
            "tandem_router_decode_resumes",
            "Sequences resumed on another decode worker after a failure.",
            registry=r,
        )
        self.migrations = Counter(
            "tandem_router_migrations",
            "Streams whose decode worker shut down and handed them on, by outcome: kv (the next "
            "worker pulled their KV), recompute (it recomputed them), failed (none could continue).",
            ["outcome"], registry=r,
        )
        self.migration_seconds = Histogram(
            "tandem_router_migration_seconds",
            "Time from a leaving decode worker's MIGRATE line to the next worker's first token.",
            registry=r, buckets=_ITL_BUCKETS,
        )
        self.aborts = Counter(
            "tandem_router_aborts",
            "Abort calls sent to workers for requests that ended early.",
            registry=r,
        )
        self.routed_prompt_tokens = Counter(
            "tandem_router_prompt_tokens",
            "Prompt tokens of routed requests whose tokens the router knew (it tokenized them, or "
            "the client sent ids): the denominator of the prefix hit rate.",
            registry=r,
        )
        self.prefix_cached_tokens = Counter(
            "tandem_router_prefix_cached_tokens",
            "Prompt tokens the chosen worker already held in its prefix cache when the request was "
            "routed (as the router's index knew), by role: prefill, decode.",
            ["role"], registry=r,
        )
        self.kv_event_resyncs = Counter(
            "tandem_router_kv_event_resyncs",
            "KV event streams restarted from a snapshot because of a gap in their numbering.",
            registry=r,
        )
        self.prefix_index_blocks = Gauge(
            "tandem_router_prefix_index_blocks",
            "Prefix-cache blocks the router's index knows the workers hold, all workers together.",
            registry=r,
        )
        self.kv_event_streams = Gauge(
            "tandem_router_kv_event_streams",
            "Workers whose KV events the router follows (their snapshot arrived), for prefix-aware routing.",
            registry=r,
        )
        self.tokenizer_active = Gauge(
            "tandem_router_tokenizer_active",
            "1 while the router tokenizes requests itself (exact limits, token ids to the workers).",
            registry=r,
        )
        self.workers = Gauge(
            "tandem_router_workers", "Workers known to the router, by role and readiness.",
            ["role", "ready"], registry=r,
        )
        self.vllm = VllmMetrics(r)  # the same measurements under vLLM's names (vllm_metrics.py)
