"""`tandem router`: the OpenAI-compatible router, with static or Kubernetes discovery.

Cheap to import (the CLI table imports it for --help); aiohttp is loaded in run().
"""

from __future__ import annotations

import argparse
import os

from tandem.contracts import gateway
from tandem.contracts.internal_auth import load_secret
from tandem.contracts.routing import FirstToken
from tandem.router.config import RouterConfig, apply, check_complete, load_yaml
from tandem.router.policies.registry import POLICIES
from tandem.router.runtimes.registry import RUNTIMES

# flag dest -> config field, for flags whose value overrides the config file when given
_FLAGS = (
    "host", "port", "namespace", "service", "worker_port", "model", "api_key", "max_body_bytes",
    "max_tokens_limit", "max_request_output_tokens", "max_request_logprobs", "default_max_tokens", "max_prompt_tokens", "short_prompt_threshold", "policy", "runtime",
    "poll_interval_s", "connect_timeout_s", "chunk_timeout_s", "prefill_timeout_s", "log_format",
    "log_level", "max_stop_chars", "tool_call_parser", "busy_wait_s", "first_token", "write_timeout_s", "stream_send_buffer_bytes",
    "shutdown_grace_s", "prefill_saturated_tokens", "decode_headroom_sequences", "prefix_sequence_cost_tokens",
    "tokenizer", "parity_probe", "parity_tolerance", "parity_recheck_s", "kv_events_port",
    "max_concurrent_requests", "flow_band_capacity", "flow_ttl_s", "flow_headroom", "ext_proc_port", "gateway_port",
    "gateway_decode", "prefill_dns",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = RouterConfig()
    parser.add_argument("--config", help="YAML file of router settings (the operator mounts one)")
    parser.add_argument("--host", default=None, help=f"listen address (default {d.host})")
    parser.add_argument("--port", type=int, default=None, help=f"listen port (default {d.port})")
    parser.add_argument("--prefill", action="append", default=[], metavar="URL",
                        help="a prefill worker's base URL (repeatable; static discovery)")
    parser.add_argument("--decode", action="append", default=[], metavar="URL",
                        help="a decode or colocated worker's base URL (repeatable; static discovery)")
    parser.add_argument("--kubernetes", action="store_true", default=None,
                        help="discover workers from the pods of --service in --namespace")
    parser.add_argument("--namespace", default=None,
                        help="namespace to watch (default: the pod's own namespace)")
    parser.add_argument("--service", default=None, help="the InferenceService name (tandem.dev/service)")
    parser.add_argument("--worker-port", type=int, default=None,
                        help=f"workers' HTTP port when the pod names no 'http' port (default {d.worker_port})")
    parser.add_argument("--model", default=None,
                        help="served model name clients must send (default: what the workers report)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' (default: env TANDEM_API_KEY)")
    parser.add_argument("--max-body-bytes", type=int, default=None,
                        help=f"largest request body accepted (default {d.max_body_bytes})")
    parser.add_argument("--max-tokens-limit", type=int, default=None,
                        help=f"most output tokens one choice may ask for (default {d.max_tokens_limit})")
    parser.add_argument("--max-request-output-tokens", type=int, default=None,
                        help="most output tokens of one request, every choice together: n x max_tokens "
                        f"(default {d.max_request_output_tokens})")
    parser.add_argument("--max-request-logprobs", type=int, default=None,
                        help="most log probabilities one answer holds: n x max_tokens x (1 + top_logprobs) "
                        f"(default {d.max_request_logprobs})")
    parser.add_argument("--default-max-tokens", type=int, default=None,
                        help="output tokens when a request names none (default: the rest of the context, "
                        "within --max-tokens-limit)")
    parser.add_argument("--tool-call-parser", default=None, choices=("hermes", "llama3_json", "mistral"),
                        help="how the served model writes tool calls (default hermes)")
    parser.add_argument("--max-prompt-tokens", type=int, default=None,
                        help="longest prompt accepted, in tokens (default: the model's context)")
    parser.add_argument("--short-prompt-threshold", type=int, default=None,
                        help="prompts below this many tokens skip prefill and go straight to a decode "
                        f"worker (default {d.short_prompt_threshold})")
    parser.add_argument("--prefill-saturated-tokens", type=int, default=None,
                        help="when every prefill worker has this many prompt tokens queued, a decode "
                        "worker with headroom prefills the prompt itself (0: never; default "
                        f"{d.prefill_saturated_tokens})")
    parser.add_argument("--decode-headroom-sequences", type=int, default=None,
                        help="a decode worker running fewer sequences than this has headroom to prefill "
                        f"when prefill is saturated (default {d.decode_headroom_sequences})")
    parser.add_argument("--prefix-sequence-cost-tokens", type=int, default=None,
                        help="prefix-aware policy: prompt tokens one running sequence on a decode worker "
                        f"weighs against its cached prefix (default {d.prefix_sequence_cost_tokens})")
    parser.add_argument("--tokenizer", default=None,
                        help="'workers' (fetch the served model's tokenizer from a worker), 'off', or a "
                        f"folder with tokenizer.json (default {d.tokenizer})")
    parser.add_argument("--runtime", choices=sorted(RUNTIMES), default=None,
                        help=f"the workers' runtime, how the router talks to them (default {d.runtime})")
    parser.add_argument("--kv-events-port", type=int, default=None,
                        help="runtime vllm: the port of each server's KV event publisher, on the server's host "
                        f"(default {d.kv_events_port})")
    parser.add_argument("--kv-events", action="append", default=[], metavar="URL=ENDPOINT",
                        help="runtime vllm: the KV event publisher of the server at URL, e.g. "
                        "http://127.0.0.1:8101=tcp://127.0.0.1:5601 (repeatable; several servers on one host)")
    parser.add_argument("--policy", choices=sorted(POLICIES), default=None,
                        help=f"how to pick workers (default {d.policy})")
    parser.add_argument("--poll-interval-s", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--connect-timeout-s", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--prefill-timeout-s", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--chunk-timeout-s", type=float, default=None,
                        help=f"silence allowed between a worker's stream lines (default {d.chunk_timeout_s})")
    parser.add_argument("--max-stop-chars", type=int, default=None,
                        help=f"longest stop string accepted (default {d.max_stop_chars})")
    parser.add_argument("--busy-wait-s", type=float, default=None,
                        help="how long a started stream waits for a busy (429/503) decode worker "
                        f"(default {d.busy_wait_s})")
    parser.add_argument("--first-token", choices=[f.value for f in FirstToken], default=None,
                        help="a handoff's first token: to the client at once (the KV handoff is a gap in the "
                        "stream after it), or with the decode worker's first token (the handoff is in the time "
                        f"to first token, the stream has no such gap) (default {d.first_token})")
    parser.add_argument("--write-timeout-s", type=float, default=None,
                        help="a streaming client that reads nothing for this long is dropped and its "
                        f"request aborted (default {d.write_timeout_s})")
    parser.add_argument("--stream-send-buffer-bytes", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--shutdown-grace-s", type=float, default=None,
                        help="on SIGTERM: stop being ready, then let streams finish for this long "
                        f"(default {d.shutdown_grace_s})")
    parser.add_argument("--max-concurrent-requests", type=int, default=None, metavar="N",
                        help="flow control: at most N requests go on to the workers at once, the rest wait "
                        "in one queue per flow (fairness id x priority) and take turns (default "
                        f"{d.max_concurrent_requests}: off)")
    parser.add_argument("--flow-band-capacity", type=int, default=None, metavar="N",
                        help="flow control: requests waiting per priority band before a new one gets 429 "
                        f"(default {d.flow_band_capacity})")
    parser.add_argument("--flow-ttl-s", type=float, default=None, metavar="S",
                        help=f"flow control: a request waits at most this long, then gets 429 (default {d.flow_ttl_s:g})")
    parser.add_argument("--flow-headroom", type=int, default=None, metavar="N",
                        help="flow control: places of --max-concurrent-requests one flow never takes, so another "
                        f"tenant's request starts at once instead of after a flood's request ends (default {d.flow_headroom})")
    parser.add_argument("--objective", action="append", default=[], metavar="NAME=PRIORITY",
                        help="flow control: requests naming objective NAME (x-gateway-inference-objective) "
                        "have this integer priority; higher goes first, others 0 (repeatable)")
    parser.add_argument("--ext-proc-port", type=int, default=None, metavar="PORT",
                        help="also serve as a Gateway API Inference Extension endpoint picker: Envoy's "
                        "ext_proc (and gRPC health) on PORT, picking with this router's policy "
                        f"(default {d.ext_proc_port}: off; the extension's port is {gateway.PICKER_PORT})")
    parser.add_argument("--gateway-port", type=int, default=None, metavar="PORT",
                        help="picker: the port of the decode pods' sidecars the picked endpoint names "
                        "(default: the worker's own port)")
    parser.add_argument("--gateway-endpoint", action="append", default=[], metavar="URL=HOST:PORT",
                        help="picker: the endpoint the gateway reaches the decode worker at URL through "
                        "(repeatable; several pods on one host)")
    parser.add_argument("--gateway-decode", default=None, metavar="URL",
                        help="serve as a decode pod's sidecar behind a gateway: every request decodes on the "
                        f"worker at URL, its prompt prefilled on the worker the picker names ({gateway.PREFILL_HEADER})")
    parser.add_argument("--prefill-dns", default=None, metavar="HOST[:PORT]",
                        help="discover the prefill workers as the addresses HOST resolves to (a headless "
                        "Service), at PORT (default --worker-port); with --decode / --gateway-decode")
    parser.add_argument("--no-parity-probe", dest="parity_probe", action="store_false", default=None,
                        help="hand KV across every pairing unchecked (default: only across pairings the "
                        "handoff parity probe proved)")
    parser.add_argument("--parity-tolerance", type=float, default=None,
                        help="largest |logprob difference| (nats) the parity probe accepts (default: by "
                        "dtype, 1e-4 for float32, 0.25 for float16, 1.0 for bfloat16)")
    parser.add_argument("--parity-recheck-s", type=float, default=None,
                        help=f"probe a worker again this long after its last verdict (0: never; default "
                        f"{d.parity_recheck_s})")
    parser.add_argument("--log-format", choices=["text", "json"], default=None)
    parser.add_argument("--log-level", default=None)


def _endpoints(pairs: list[str], flag: str = "--kv-events") -> dict[str, str]:
    """URL=ENDPOINT flags as a mapping (the URL itself holds no '=')."""
    out = {}
    for pair in pairs:
        url, sep, endpoint = pair.partition("=")
        if not sep:
            raise SystemExit(f"tandem router: {flag} wants URL=ENDPOINT, got {pair!r}")
        out[url.rstrip("/")] = endpoint
    return out


def _objectives(items: list[str]) -> dict[str, int]:
    out = {}
    for item in items:
        name, sep, priority = item.partition("=")
        try:
            if not (sep and name.strip()):
                raise ValueError
            out[name.strip()] = int(priority)
        except ValueError:
            raise SystemExit(f"tandem router: --objective takes NAME=PRIORITY (an integer), got {item!r}") from None
    return out


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """Defaults < --config file < env TANDEM_API_KEY < flags; the internal secret from
    $TANDEM_INTERNAL_SECRET only."""
    config = load_yaml(args.config) if args.config else RouterConfig()
    values = {f: getattr(args, f) for f in _FLAGS if getattr(args, f, None) is not None}
    if args.prefill:
        values["prefill"] = args.prefill
    if args.decode:
        values["decode"] = args.decode
    if args.kubernetes:
        values["kubernetes"] = True
    if args.kv_events:
        values["kv_events_endpoints"] = _endpoints(args.kv_events)
    if args.gateway_endpoint:
        values["gateway_endpoints"] = _endpoints(args.gateway_endpoint, "--gateway-endpoint")
    if args.objective:
        values["objectives"] = {**config.objectives, **_objectives(args.objective)}
    if "api_key" not in values and os.environ.get("TANDEM_API_KEY"):
        values["api_key"] = os.environ["TANDEM_API_KEY"]
    config = apply(config, values, "flags")
    check_complete(config)  # what the runtime needs, once every source is applied (ValueError, as apply)
    try:
        config.internal_secret = load_secret(os.environ, None)
    except ValueError as e:
        raise SystemExit(f"tandem router: {e}") from None
    if config.kubernetes:
        if not config.service:
            raise SystemExit("tandem router: --kubernetes needs --service (the InferenceService name)")
        if not config.namespace:
            ns_file = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
            if not os.path.exists(ns_file):
                raise SystemExit("tandem router: --kubernetes needs --namespace outside a pod")
            with open(ns_file) as f:
                config.namespace = f.read().strip()
    elif not (config.prefill or config.decode or config.gateway_decode):
        raise SystemExit("tandem router: give --decode URL (and --prefill URL), or --kubernetes")
    return config


def run(args: argparse.Namespace) -> int:
    import asyncio

    from tandem.contracts.logs import configure_logging

    config = config_from_args(args)
    configure_logging(config.log_format, config.log_level)
    discovery = None
    if config.kubernetes:
        from kubernetes import client
        from kubernetes import config as kconfig
        from tandem.router.discovery.kubernetes import KubernetesDiscovery

        try:
            kconfig.load_incluster_config()
        except kconfig.ConfigException:
            kconfig.load_kube_config()
        discovery = KubernetesDiscovery(
            client.ApiClient(), config.namespace, config.service, on_change=lambda t: None,
            default_port=config.worker_port, request_timeout_s=config.kube_request_timeout_s,
            watch_timeout_s=config.watch_timeout_s, watch_stall_s=config.watch_stall_s,
        )
    elif config.prefill_dns:
        from tandem.router.discovery.dns import DnsDiscovery, parse_host

        host, port = parse_host(config.prefill_dns, config.worker_port)
        decode = [*config.decode, *([config.gateway_decode] if config.gateway_decode else [])]
        discovery = DnsDiscovery(host, port, list(dict.fromkeys(u.rstrip("/") for u in decode)),
                                 interval_s=max(1.0, config.poll_interval_s))
    return asyncio.run(serve(config, discovery))


async def serve(config: RouterConfig, discovery: object = None) -> int:
    """Serve until SIGTERM/SIGINT, then shut down gracefully: /ready turns 503 at once (the Service
    stops sending), new requests get 503, streams in flight may finish within `shutdown_grace_s`,
    and only then the listener closes and what is left is aborted on the workers."""
    import asyncio
    import logging
    import signal

    from aiohttp import web
    from tandem.router.app import ROUTER_KEY, build_app

    app = build_app(config, discovery)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts the
    # request on the workers at once (instead of at the next write)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, config.host, config.port).start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        logging.getLogger("tandem.router").info("listening on %s:%d", config.host, config.port)
        await stop.wait()
        await app[ROUTER_KEY].drain(config.shutdown_grace_s)
    finally:
        await runner.cleanup()
    return 0
