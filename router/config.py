"""The router's configuration: defaults, then the YAML file the operator mounts, then flags.

YAML keys may be snake_case or camelCase (the operator renders from a camelCase spec), e.g.
`maxTokensLimit` or `max_tokens_limit`; nested `limits:` / `routing:` / `timeouts:` sections are
flattened. Unknown keys are refused, so a typo in a ConfigMap is an error, not a silent default.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.contracts import request_limits, timing
from tandem.contracts.handoff_parity import RECHECK_S
from tandem.contracts.routing import (
    DECODE_HEADROOM_SEQUENCES,
    PREFILL_SATURATED_TOKENS,
    PREFIX_SEQUENCE_COST_TOKENS,
    FirstToken,
)
from tandem.contracts.runtimes import DEFAULT_RUNTIME, Runtime
from tandem.contracts.vllm_serve import KV_EVENTS_PORT
from tandem.router.flow_control import FlowConfig
from tandem.router.policies.registry import check_policy
from tandem.router.runtimes.registry import check_runtime


@dataclass
class RouterConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    prefill: list[str] = field(default_factory=list)  # static discovery
    decode: list[str] = field(default_factory=list)
    kubernetes: bool = False  # in-cluster discovery
    namespace: str | None = None
    service: str | None = None
    worker_port: int = 8000  # workers' HTTP port when the pod spec names none ("http")
    model: str | None = None  # served model name; None: as the workers report it
    runtime: str = DEFAULT_RUNTIME.value  # whose workers: a name in runtimes/registry.py (how the router reaches them)
    # runtime vllm: where each server publishes its KV events (prefix-aware routing): the worker's host
    # at this port, or per worker URL a ZMQ endpoint (several servers on one host, as `tandem up` runs them)
    kv_events_port: int = KV_EVENTS_PORT
    kv_events_endpoints: dict[str, str] = field(default_factory=dict)
    api_key: str | None = None
    # The service's internal secret for the workers' /internal/* (tandem.contracts.internal_auth):
    # from $TANDEM_INTERNAL_SECRET only, never from the YAML file or argv.
    internal_secret: str | None = field(default=None, repr=False)
    max_body_bytes: int = 4 * 1024 * 1024
    max_tokens_limit: int = request_limits.MAX_OUTPUT_TOKENS  # max_tokens of one choice
    # one request's n x max_tokens, and its log probabilities: n x max_tokens x (1 + top_logprobs)
    max_request_output_tokens: int = request_limits.MAX_REQUEST_OUTPUT_TOKENS
    max_request_logprobs: int = request_limits.MAX_REQUEST_LOGPROBS
    default_max_tokens: int | None = None  # None: the rest of the context (within max_tokens_limit), as vLLM
    max_prompt_tokens: int | None = None
    max_stop_chars: int = 256  # longest stop string accepted
    short_prompt_threshold: int = 0  # prompt tokens; 0 sends every prompt through prefill
    policy: str = "least-loaded"  # a name in policies/registry.py
    # load-aware disaggregation (policies/base.py): prompt tokens queued on every prefill worker that
    # make the pool saturated (0: never), and the decode worker's headroom to prefill then
    prefill_saturated_tokens: int = PREFILL_SATURATED_TOKENS
    decode_headroom_sequences: int = DECODE_HEADROOM_SEQUENCES
    prefix_sequence_cost_tokens: int = PREFIX_SEQUENCE_COST_TOKENS  # prefix-aware: a running sequence, in tokens
    tokenizer: str = "workers"  # workers (GET /internal/tokenizer) | off | a folder with the files
    tool_call_parser: str = "hermes"  # how the served model writes tool calls: hermes | llama3_json | mistral
    poll_interval_s: float = 0.5
    connect_timeout_s: float = timing.CONNECT_TIMEOUT_S
    prefill_timeout_s: float = timing.PREFILL_TIMEOUT_S
    chunk_timeout_s: float = timing.CHUNK_TIMEOUT_S
    max_prefill_attempts: int = 2
    max_resumes: int = 2
    busy_wait_s: float = timing.BUSY_WAIT_S  # waiting for a busy (429/503) decode worker once a stream started
    # A handoff's first token: to the client at once (the KV handoff is then a gap in its stream), or
    # with the decode worker's first output (the handoff is in its time to first token): FirstToken.
    first_token: str = FirstToken.AT_ONCE.value
    write_timeout_s: float = 5.0  # a client that reads nothing for this long is dropped, its request aborted
    stream_send_buffer_bytes: int = 64 * 1024  # kernel send buffer of a streaming connection (0: OS default)
    shutdown_grace_s: float = 30.0  # on SIGTERM: not ready at once, streams may finish for this long
    kube_request_timeout_s: float = 10.0  # one list (or connect) call to the API server
    watch_timeout_s: int = 60  # the API server ends each watch after this; a relist follows
    watch_stall_s: float = 30.0  # a watch silent this much longer than its timeout is stalled: relist
    # The handoff parity probe (router/parity/decisions.py): a pairing takes KV handoffs only once proven.
    parity_probe: bool = True
    parity_tolerance: float | None = None  # nats; None: by the workers' dtype (parity.TOLERANCE)
    parity_recheck_s: float = RECHECK_S  # probe a worker again this long after its verdict (0: never)
    parity_probe_timeout_s: float = 30.0
    log_format: str = "text"
    log_level: str = "info"
    # Flow control (router/flow_control.py): requests past the router's gate at once (0: off), waiting
    # requests per priority band, how long one may wait, objective name -> priority.
    max_concurrent_requests: int = 0
    flow_band_capacity: int = 256
    flow_ttl_s: float = 30.0
    flow_headroom: int = 1  # places one flow never takes: another tenant's request starts at once
    objectives: dict[str, int] = field(default_factory=dict)
    # Behind a gateway (contracts/gateway.py). The endpoint picker: Envoy's ext_proc over gRPC on this
    # port (0: off); it names a decode worker's pod by its sidecar: per worker URL an endpoint
    # (several on one host), else the worker's host at gateway_port (0: the worker's own port).
    ext_proc_port: int = 0
    gateway_port: int = 0
    gateway_endpoints: dict[str, str] = field(default_factory=dict)
    # A decode pod's sidecar: every request decodes on this worker (its URL), prefilled on the worker
    # the picker named in x-gateway-prefill-endpoints (None: not a sidecar)
    gateway_decode: str | None = None
    # Prefill workers by DNS (HOST[:PORT], a headless Service: the sidecar, which has no API access)
    prefill_dns: str | None = None


_SECTIONS = {"limits", "routing", "timeouts", "discovery", "server", "router"}
_ALIASES = {
    "max_output_tokens": "max_tokens_limit",
    "max_tokens": "max_tokens_limit",
    "max_body_size": "max_body_bytes",
    "routing_policy": "policy",
    "short_prompt_tokens": "short_prompt_threshold",
    "served_model_name": "model",
}


def _snake(key: str) -> str:
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", key).replace("-", "_").lower()


def flatten(raw: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in raw.items():
        k = _snake(str(key))
        if k in _SECTIONS and isinstance(value, dict):
            out.update(flatten(value))
        else:
            out[_ALIASES.get(k, k)] = value
    return out


def apply(config: RouterConfig, values: dict[str, Any], source: str) -> RouterConfig:
    """Overlay `values` on `config`; refuse unknown keys naming `source`."""
    known = {f.name for f in dataclasses.fields(RouterConfig)} - {"internal_secret"}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{source}: unknown router settings {unknown}; known: {sorted(known)}")
    out = dataclasses.replace(config, **values)
    try:
        check_runtime(out.runtime)
        check_policy(out.policy)
        _check_routing(out)
        _check_kv_events(out)
        _check_flow(out)
        _check_gateway(out)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    return out


def _check_kv_events(c: RouterConfig) -> None:
    if not isinstance(c.kv_events_port, int) or isinstance(c.kv_events_port, bool) or not 0 < c.kv_events_port < 65536:
        raise ValueError(f"kv_events_port must be a port number, got {c.kv_events_port!r}")
    bad = [f"{k}={v}" for k, v in (c.kv_events_endpoints or {}).items()
           if not (isinstance(k, str) and k.startswith(("http://", "https://")) and isinstance(v, str)
                   and v.startswith(("tcp://", "ipc://")))]
    if not isinstance(c.kv_events_endpoints, dict) or bad:
        raise ValueError("kv_events_endpoints maps a worker URL (http://...) to a ZMQ endpoint (tcp://HOST:PORT), "
                         f"got {bad or c.kv_events_endpoints!r}")


def _check_flow(c: RouterConfig) -> None:
    for name, least in (("max_concurrent_requests", 0), ("flow_band_capacity", 1), ("flow_headroom", 0)):
        value = getattr(c, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    if not isinstance(c.flow_ttl_s, int | float) or isinstance(c.flow_ttl_s, bool) or not 0 < c.flow_ttl_s < float("inf"):
        raise ValueError(f"flow_ttl_s must be a number of seconds > 0, got {c.flow_ttl_s!r}")
    bad = {k: v for k, v in (c.objectives or {}).items()
           if not (isinstance(k, str) and k and isinstance(v, int) and not isinstance(v, bool))} \
        if isinstance(c.objectives, dict) else c.objectives
    if bad:
        raise ValueError(f"objectives maps an objective's name to an integer priority, got {bad!r}")


def _check_gateway(c: RouterConfig) -> None:
    for name in ("ext_proc_port", "gateway_port"):
        value = getattr(c, name)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 65536:
            raise ValueError(f"{name} must be a port number (0: off), got {value!r}")
    bad = [f"{k}={v}" for k, v in (c.gateway_endpoints or {}).items()
           if not (isinstance(k, str) and k.startswith(("http://", "https://")) and isinstance(v, str)
                   and re.fullmatch(r"[^\s,/]+:\d+", v))]
    if not isinstance(c.gateway_endpoints, dict) or bad:
        raise ValueError("gateway_endpoints maps a decode worker URL (http://...) to the endpoint the gateway "
                         f"reaches its pod at (HOST:PORT), got {bad or c.gateway_endpoints!r}")
    if c.gateway_decode is not None and not (isinstance(c.gateway_decode, str)
                                             and c.gateway_decode.startswith(("http://", "https://"))):
        raise ValueError(f"gateway_decode is the URL of the pod's decode worker (http://...), got {c.gateway_decode!r}")


def flow_config(c: RouterConfig) -> FlowConfig:
    return FlowConfig(max_concurrent=c.max_concurrent_requests, band_capacity=c.flow_band_capacity,
                      ttl_s=float(c.flow_ttl_s), headroom=c.flow_headroom, objectives=dict(c.objectives))


def _check_routing(c: RouterConfig) -> None:
    for name, least in (("short_prompt_threshold", 0), ("prefill_saturated_tokens", 0),
                        ("decode_headroom_sequences", 1), ("prefix_sequence_cost_tokens", 0),
                        ("max_request_output_tokens", 1), ("max_request_logprobs", 1)):
        value = getattr(c, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    if c.parity_tolerance is not None and not (isinstance(c.parity_tolerance, int | float)
                                               and 0 <= c.parity_tolerance < float("inf")):
        raise ValueError(f"parity_tolerance must be a number >= 0 (nats), got {c.parity_tolerance!r}")
    from tandem.router.tool_parsers import PARSERS

    if c.first_token not in {f.value for f in FirstToken}:
        raise ValueError(f"first_token must be one of {[f.value for f in FirstToken]}, got {c.first_token!r}")
    if c.tool_call_parser not in PARSERS:
        raise ValueError(f"tool_call_parser must be one of {sorted(PARSERS)}, got {c.tool_call_parser!r}")
    if c.tokenizer not in ("workers", "off") and not (Path(c.tokenizer) / "tokenizer.json").is_file():
        raise ValueError(f"tokenizer must be 'workers', 'off' or a folder with tokenizer.json, got {c.tokenizer!r}")


def check_complete(c: RouterConfig) -> None:
    """What only the whole configuration can say (every source applied): what its runtime needs.
    ValueError saying what to set."""
    if c.runtime != Runtime.VLLM:
        return
    if c.tokenizer in ("workers", "off"):
        raise ValueError("runtime vllm needs the served model's tokenizer files in a folder (--tokenizer DIR, "
                         "tokenizer: DIR): vLLM serves none, and the router sends vLLM token ids")


def load_yaml(path: str | Path, config: RouterConfig | None = None) -> RouterConfig:
    import yaml

    raw = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping of router settings")
    return apply(config or RouterConfig(), flatten(raw), str(path))
