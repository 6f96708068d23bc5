"""The router's part of the InferenceService spec: its Service, limits, API key, routing knobs and pod
settings. Declared like the rest of the spec (tandem.operator.spec.fields)."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.contracts import request_limits
from tandem.contracts.routing import (
    DECODE_HEADROOM_SEQUENCES,
    PREFILL_SATURATED_TOKENS,
    PREFIX_SEQUENCE_COST_TOKENS,
    FirstToken,
    RoutingPolicy,
)
from tandem.operator.spec.fields import Quantity, api_field
from tandem.operator.spec.pod import (
    DNS_SUBDOMAIN,
    DisruptionBudget,
    Image,
    LocalObjectReference,
    image_pull_secrets,
    pod_disruption_budget,
    priority_class_name,
    runtime_class_name,
    service_account_name,
)

api_type = dataclass(frozen=True, kw_only=True)


@api_type
class RouterService:
    """The router's Service: the InferenceService's endpoint."""

    type: str = api_field("type", enum=["ClusterIP", "NodePort", "LoadBalancer"], default="ClusterIP")
    port: int = api_field("port", minimum=1, maximum=65535, default=8000, description="Port of the router Service.")


@api_type
class RouterLimits:
    """What the router refuses with a 4xx before any worker sees the request."""

    max_prompt_tokens: int | None = api_field(
        "maxPromptTokens", minimum=1, description="Longest prompt accepted (default: model.maxModelLen - 1).")
    max_output_tokens: int | None = api_field(
        "maxOutputTokens", minimum=1, description=f"Largest max_tokens one choice may ask for (default: "
        f"{request_limits.MAX_OUTPUT_TOKENS}, or model.maxModelLen - 1 when that is smaller).")
    max_request_output_tokens: int = api_field(
        "maxRequestOutputTokens", minimum=1, maximum=16777216, default=request_limits.MAX_REQUEST_OUTPUT_TOKENS,
        description="Most output tokens one request may ask for, every choice together (n x max_tokens).")
    max_request_logprobs: int = api_field(
        "maxRequestLogprobs", minimum=1, maximum=16777216, default=request_limits.MAX_REQUEST_LOGPROBS,
        description="Most log probabilities one answer may hold (n x max_tokens x (1 + top_logprobs)): a "
        "non-streamed answer is held whole in the router, about 15 KB per token at top_logprobs 20 while it is built.")
    max_body_bytes: int = api_field(
        "maxBodyBytes", minimum=1024, maximum=1073741824, default=1048576,
        description="Largest request body in bytes.")


@api_type
class SecretKeyRef:
    """A key of a Secret in the InferenceService's namespace."""

    name: str = api_field("name", max_length=253, pattern=DNS_SUBDOMAIN)
    key: str = api_field("key", max_length=253, pattern="^[-._a-zA-Z0-9]+$", default="api-key")


@api_type
class FlowControl:
    """The router's (and the endpoint picker's) flow control: a queue per tenant and priority
    (router/flow_control.py). Off unless maxConcurrentRequests is set."""

    max_concurrent_requests: int = api_field(
        "maxConcurrentRequests", minimum=0, maximum=1000000, default=0,
        description="Requests each router pod lets on to the workers at once; the rest wait in one queue per "
        "flow (the x-gateway-inference-fairness-id header, else the API key) and take turns (0: off).")
    band_capacity: int = api_field(
        "bandCapacity", minimum=1, maximum=1000000, default=256,
        description="Requests waiting per priority before a new one is refused with 429 and Retry-After.")
    ttl_seconds: float = api_field(
        "ttlSeconds", minimum=0, exclusive_minimum=True, maximum=3600, default=30.0,
        description="How long a request may wait for its turn before a 429.")
    headroom: int = api_field(
        "headroom", minimum=0, maximum=1000000, default=1,
        description="Places of maxConcurrentRequests one tenant never takes, so another tenant's request starts "
        "at once instead of waiting for a flood's request to end.")
    objectives: dict[str, int] | None = api_field(
        "objectives", max_properties=64, values={"minimum": -1000000, "maximum": 1000000},
        description="Objective name (x-gateway-inference-objective) -> integer priority; higher goes first; "
        "a request naming none, or another, is priority 0.")


@api_type
class Router:
    """The OpenAI-compatible router in front of the workers."""

    replicas: int = api_field("replicas", minimum=0, maximum=100, default=1)
    service: RouterService = api_field("service", default={})
    policy: str = api_field(
        "policy", enum=[p.value for p in RoutingPolicy], default=RoutingPolicy.LEAST_LOADED.value,
        description="How the router picks workers: least-loaded (prefill by queued prompt tokens, decode "
        "by running sequences and KV usage), round-robin (each pool in turn) or prefix-aware (by the prompt "
        "tokens a worker must still compute, from the prefix cache it holds, weighed against its load).")
    short_prompt_tokens: int = api_field(
        "shortPromptTokens", minimum=0, maximum=1048576, default=0,
        description="Prompts below this many tokens skip prefill and are prefilled by decode (0: always "
        "disaggregate); prefix-aware: also a prompt whose decode worker holds all but this many tokens.")
    prefill_saturated_tokens: int = api_field(
        "prefillSaturatedTokens", minimum=0, maximum=1048576, default=PREFILL_SATURATED_TOKENS,
        description="Load-aware disaggregation: when every prefill worker has this many prompt tokens "
        "queued, a decode worker with headroom prefills the prompt itself (0: never).")
    decode_headroom_sequences: int = api_field(
        "decodeHeadroomSequences", minimum=1, maximum=65536, default=DECODE_HEADROOM_SEQUENCES,
        description="A decode worker running fewer sequences than this (with KV usage under 90% and a "
        "shorter prompt queue than prefill) has headroom to prefill when prefill is saturated.")
    prefix_sequence_cost_tokens: int = api_field(
        "prefixSequenceCostTokens", minimum=0, maximum=1048576, default=PREFIX_SEQUENCE_COST_TOKENS,
        description="prefix-aware: how many prompt tokens one sequence running on a decode worker weighs "
        "against the prefix it holds (higher spreads a hot prefix sooner).")
    first_token: str = api_field(
        "firstToken", enum=[f.value for f in FirstToken], default=FirstToken.AT_ONCE.value,
        description="When a handoff's first token (the prefill worker's) reaches the client: at-once (the KV "
        "handoff is then a gap in the stream after it) or with-decode (with the decode worker's first token: "
        "the handoff is in the time to first token, and the stream has no such gap).")
    limits: RouterLimits = api_field("limits", default={})
    flow_control: FlowControl = api_field("flowControl", default={})
    api_key_secret_ref: SecretKeyRef | None = api_field(
        "apiKeySecretRef", description="A Secret holding the API key clients must send as a Bearer token.")
    image: Image | None = api_field(
        "image", description="The router's own image (the Dockerfile's router target, no torch); unset fields "
        "come from the operator's router image (its tag from spec.image.tag when that pins one).")
    cpu: Quantity | None = api_field("cpu", description="CPU request and limit per router pod.")
    memory: Quantity | None = api_field("memory", description="Memory request and limit per router pod.")
    # Pod settings a platform needs (spec/pod.py).
    priority_class_name: str | None = priority_class_name()
    runtime_class_name: str | None = runtime_class_name()
    image_pull_secrets: tuple[LocalObjectReference, ...] | None = image_pull_secrets()
    service_account_name: str | None = service_account_name(
        "An existing ServiceAccount for the router pods instead of the one the operator creates; the operator "
        "binds its Role (list pods and EndpointSlices, read ReplicaSets) to it.")
    pod_disruption_budget: DisruptionBudget = pod_disruption_budget()
