"""The router's HTTP face: the OpenAI API, health, readiness and metrics (aiohttp).

Streaming responses start (HTTP 200 and SSE headers) only once a worker accepted the request,
so errors found by the worker (context length, ...) still reach the client as a 4xx. A request
that ends early for any reason has every worker it touched told to abort it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from tandem.contracts import gateway
from tandem.contracts.names import Role
from tandem.contracts.protocol import REQUEST_ID_HEADER
from tandem.contracts.routing import FirstToken
from tandem.router import request_gate, tokenize_api
from tandem.router.chat_fields import decode_echo
from tandem.router.config import RouterConfig, flow_config
from tandem.router.errors import RouterError, bad_request, no_worker
from tandem.router.flow_control import FlowController
from tandem.router.journey import ClientRequest
from tandem.router.kv_feed import KVEventFeed
from tandem.router.metrics import RouterMetrics
from tandem.router.orchestrator import Orchestrator
from tandem.router.parity import checker as parity_checker
from tandem.router.parity.checker import ParityChecker
from tandem.router.policies.base import Pinned, PolicySettings, RoutingPolicy
from tandem.router.policies.registry import policy_class
from tandem.router.prefix_index import PrefixIndex
from tandem.router.responses import Responder
from tandem.router.runtimes.registry import create_client
from tandem.router.sse import ResponseShape
from tandem.router.tokenizer import ChatTemplateError
from tandem.router.tokenizer_sync import OFF, WORKERS, TokenizerSync
from tandem.router.validation import (
    Endpoint,
    Limits,
    ParsedRequest,
    check_model,
    parse_request,
)
from tandem.router.worker_client import WorkerClient
from tandem.router.workers import Target, WorkerSet

if TYPE_CHECKING:
    from tandem.router.picker import PickerServer

log = logging.getLogger("tandem.router")

ROUTER_KEY: web.AppKey[Router] = web.AppKey("router")
TOKENIZER_START_WAIT_S = 10.0  # at start-up, how long a tokenizer fetch from a ready worker may delay serving
PARITY_START_WAIT_S = 10.0  # at start-up, how long proving the ready pairings may delay serving


def _error_response(err: RouterError, request_id: str | None = None) -> web.Response:
    headers = dict(err.headers)
    if request_id:
        headers[REQUEST_ID_HEADER] = request_id
    return web.json_response(err.body, status=err.status, headers=headers)


@web.middleware
async def openai_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every error leaves in OpenAI's format, including aiohttp's own 404/405/413."""
    try:
        return await handler(request)
    except RouterError as err:
        return _error_response(err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status)
        type_ = "invalid_request_error" if exc.status < 500 else "server_error"
        return _error_response(RouterError(exc.status, exc.reason, type_, None, code))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:  # a bug: logged with its traceback, the client gets no internals
        log.exception("unhandled error serving %s %s", request.method, request.path)
        return _error_response(RouterError(500, "internal error in the router", "server_error"))


class Router:
    """Everything one router process holds: config, worker set, orchestrator and metrics."""

    def __init__(self, config: RouterConfig, discovery: Any = None) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        self.limits = Limits(
            max_tokens_limit=config.max_tokens_limit, default_max_tokens=config.default_max_tokens,
            max_request_output_tokens=config.max_request_output_tokens,
            max_request_logprobs=config.max_request_logprobs,
            max_prompt_tokens=config.max_prompt_tokens,
            max_stop_chars=config.max_stop_chars, tool_call_parser=config.tool_call_parser,
        )
        self.discovery = discovery  # None: static targets from config
        self.flow = FlowController(flow_config(config))  # off unless max_concurrent_requests is set
        self.created = int(time.time())
        self.session: aiohttp.ClientSession | None = None
        self.workers: WorkerSet | None = None
        self.orchestrator: Orchestrator | None = None
        self.responder: Responder | None = None
        self.tokens: TokenizerSync | None = None
        self.index: PrefixIndex | None = None  # only for a policy that routes by prefix
        self.feed: KVEventFeed | None = None
        self.parity: ParityChecker | None = None  # the handoff parity probe (parity/checker.py)
        self.picker: PickerServer | None = None  # the endpoint picker (picker.py), with --ext-proc-port
        self._poller: asyncio.Task | None = None
        self.draining = False  # SIGTERM: not ready, new requests refused, streams finish
        self._active = 0  # generation requests being served
        self._idle = asyncio.Event()
        self._idle.set()

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self, app: web.Application) -> None:
        from tandem.router.discovery.static import static_targets

        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        client = create_client(self.session, self.config)  # the configured runtime's (runtimes/)
        if self.config.internal_secret is None:
            log.warning("no internal secret ($TANDEM_INTERNAL_SECRET): workers that require one will "
                        "refuse this router")
        self.tokens = TokenizerSync(client, self.config.tokenizer)
        if self.config.tokenizer not in (WORKERS, OFF):
            self.tokens.load_dir()
        policy = self._policy(client)
        self.workers = WorkerSet(client, poll_interval_s=self.config.poll_interval_s, served_model=self.config.model,
                                 listeners=[self.tokens.refresh], prefix_index=self.index)
        if self.config.parity_probe:
            c = self.config
            self.parity = ParityChecker(client, self.metrics.registry, c.parity_tolerance, c.parity_recheck_s,
                                        c.parity_probe_timeout_s)
            self.parity.attach(self.workers)
        self.orchestrator = Orchestrator(
            client,
            self.workers,
            policy,
            self.metrics,
            limits=self.limits,
            max_prefill_attempts=self.config.max_prefill_attempts,
            max_resumes=self.config.max_resumes,
            busy_wait_s=self.config.busy_wait_s,
            hold_first_token=self.config.first_token == FirstToken.WITH_DECODE,
        )
        self.responder = Responder(
            self.orchestrator, self.metrics, write_timeout_s=self.config.write_timeout_s,
            send_buffer_bytes=self.config.stream_send_buffer_bytes,
        )
        if self.discovery is None:
            decode = [*self.config.decode, *([self.config.gateway_decode] if self.config.gateway_decode else [])]
            self.set_targets(static_targets(self.config.prefill, list(dict.fromkeys(u.rstrip("/") for u in decode))))
        else:
            self.discovery.on_change = self.set_targets
            self.discovery.start(asyncio.get_running_loop())
        await self.workers.poll_once()
        # the first requests are tokenized here too, and handed off across proven pairings
        await asyncio.gather(self.tokens.wait_loaded(TOKENIZER_START_WAIT_S),
                             self.parity.settle(PARITY_START_WAIT_S) if self.parity else asyncio.sleep(0))
        self._poller = asyncio.create_task(self.workers.run())
        if self.config.ext_proc_port:
            from tandem.router.picker import PickerServer

            self.picker = PickerServer(self, self.config.host, self.config.ext_proc_port)
            await self.picker.start()

    def _policy(self, client: WorkerClient) -> RoutingPolicy:
        """The configured policy; for one that routes by prefix, the index the workers' KV events feed
        (the worker set reads it into each snapshot: the policy never sees it)."""
        cls, c = policy_class(self.config.policy), self.config
        if cls.uses_prefix_index:
            self.index = PrefixIndex()
            self.feed = KVEventFeed(client, self.index, self.metrics)
        return cls(PolicySettings(
            short_prompt_threshold=c.short_prompt_threshold, prefill_saturated_tokens=c.prefill_saturated_tokens,
            decode_headroom_sequences=c.decode_headroom_sequences,
            prefix_sequence_cost_tokens=c.prefix_sequence_cost_tokens))

    def set_targets(self, targets: list[Target]) -> None:
        assert self.workers is not None
        self.workers.set_targets(targets)
        if self.feed is not None:
            self.feed.set_targets(self.workers.urls())

    async def drain(self, grace_s: float) -> bool:
        """Stop being ready and refuse new requests, then wait (at most `grace_s`) for the requests in
        flight to finish; True if they all did."""
        self.draining = True
        log.info("draining: %d requests in flight, up to %.0f s", self._active, grace_s)
        try:
            await asyncio.wait_for(self._idle.wait(), grace_s)
            return True
        except TimeoutError:
            log.warning("shutdown grace of %.0f s over with %d requests in flight", grace_s, self._active)
            return False

    async def stop(self, app: web.Application) -> None:
        if self.picker is not None:
            await self.picker.stop()
        if self.discovery is not None:
            self.discovery.stop()
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        if self.feed is not None:
            await self.feed.close()
        if self.parity is not None:
            await self.parity.stop()
        if self.orchestrator is not None:
            await self.orchestrator.drain()
        if self.session is not None:
            await self.session.close()

    # --- small endpoints ----------------------------------------------------------------------

    def turn(self, key: tuple[str, int]) -> contextlib.AbstractAsyncContextManager[None]:
        """The turn at flow control of a request of flow `key` (`flow_key`), held until its answer is
        sent (request_gate.py)."""
        return request_gate.turn(self.flow, self.metrics, key)

    def flow_key(self, headers: Mapping[str, str]) -> tuple[str, int]:
        return request_gate.flow_key(self.flow, headers)

    def check_auth(self, headers: Mapping[str, str]) -> None:
        request_gate.check_api_key(self.config.api_key, headers)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    def _counts(self) -> dict[str, dict[str, int]]:
        assert self.workers is not None
        counts: dict[str, dict[str, int]] = {r.value: {"ready": 0, "total": 0} for r in Role}
        for v in self.workers.views():
            counts[v.role.value]["total"] += 1
            counts[v.role.value]["ready"] += int(v.ready)
        return counts

    async def ready(self, request: web.Request) -> web.Response:
        """Ready when some path can serve: a decode or colocated worker (prefill is optional); /v1/models
        lists the model by the same rule."""
        assert self.workers is not None
        ok = self.workers.can_serve() and not self.draining
        status = "draining" if self.draining else "ready" if ok else "not ready"
        return web.json_response({"status": status, "workers": self._counts()}, status=200 if ok else 503)

    async def models(self, request: web.Request) -> web.Response:
        self.check_auth(request.headers)
        assert self.workers is not None
        model = self.workers.listed_model()
        data = [] if model is None else [
            {"id": model, "object": "model", "created": self.created, "owned_by": "tandem"}
        ]
        return web.json_response({"object": "list", "data": data})

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        self.metrics.tokenizer_active.set(int(self.tokens is not None and self.tokens.active))
        self.metrics.prefix_index_blocks.set(self.index.total_blocks() if self.index is not None else 0)
        self.metrics.kv_event_streams.set(self.index.workers() if self.index is not None else 0)
        assert self.workers is not None
        self.metrics.vllm.workers(self.workers.model(), self.workers.views())
        for role, c in self._counts().items():
            self.metrics.workers.labels(role, "true").set(c["ready"])
            self.metrics.workers.labels(role, "false").set(c["total"] - c["ready"])
        resp = web.Response(body=generate_latest(self.metrics.registry))
        resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        return resp

    # --- generation ---------------------------------------------------------------------------

    async def _pin(self, parsed: ParsedRequest, headers: Mapping[str, str]) -> None:
        """Behind a gateway, as a decode pod's sidecar (`gateway_decode`): the request decodes on this
        pod's worker, prefilled on the worker the gateway's picker named (contracts/gateway.py), which
        the policy checks against the workers this router knows (policies/base.py `pinned_route`)."""
        decode = self.config.gateway_decode
        if decode:
            parsed.pinned = Pinned(decode.rstrip("/"), tuple(gateway.parse_endpoints(headers.get(gateway.PREFILL_HEADER))))

    async def tokenize(self, parsed: ParsedRequest) -> None:
        """Replace the prompt or messages by their token ids when the router tokenizes (tokenizer_sync.py)."""
        assert self.tokens is not None
        try:
            ids = await self.tokens.token_ids(parsed)
        except ChatTemplateError as e:
            raise bad_request(str(e), "messages") from None
        if ids is not None:
            parsed.prompt_token_ids, parsed.prompt, parsed.messages = ids, None, None

    def _default_max_tokens(self, parsed: ParsedRequest) -> None:
        """A request naming no max_tokens may generate the rest of the context (within the limits: its
        choices' share, request_budget.py); without the prompt's tokens, the worker stops at the context."""
        if parsed.max_tokens_given or self.limits.default_max_tokens is not None:
            return
        assert self.workers is not None
        context = self.workers.max_model_len()
        if context is not None and parsed.prompt_token_ids is not None:
            rest = max(1, context - len(parsed.prompt_token_ids))
            parsed.sampling.max_tokens = min(rest, parsed.sampling.max_tokens)  # the limits' default

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, Endpoint.CHAT)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, Endpoint.COMPLETION)

    async def _generate(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        assert self.workers is not None and self.orchestrator is not None
        request_id = uuid.uuid4().hex
        record = ClientRequest(request_id)
        t0 = time.monotonic()
        status = "500"
        self.metrics.in_flight.inc()
        self._active += 1
        self._idle.clear()
        try:
            try:
                if self.draining:
                    raise no_worker("this router is shutting down; retry (another replica serves).", 1)
                self.check_auth(request.headers)
                body = await request_gate.read_body(request, self.config.max_body_bytes)
                parsed = parse_request(body, endpoint, self.limits)
                served = self.workers.model()
                if served is None:  # no worker has answered yet: which model is unknown
                    raise no_worker("no worker is ready yet; retry shortly.")
                check_model(parsed.model, served)
                if parsed.echo_ids:
                    parsed.echo = decode_echo(self.tokens, parsed.prompt_token_ids or [])
                await self._pin(parsed, request.headers)
                parsed.flow = self.flow_key(request.headers)
                await self.tokenize(parsed)
                self._default_max_tokens(parsed)
                shape = ResponseShape(
                    endpoint, request_id, parsed.model, int(time.time()), parsed.include_usage
                )
                assert self.responder is not None
                async with self.turn(parsed.flow):
                    if parsed.stream:
                        resp, status = await self.responder.stream(request, parsed, shape, record, t0)
                    else:
                        resp = await self.responder.complete(parsed, shape, record, t0)
                        status = "200"
                        self.metrics.e2e.observe(time.monotonic() - t0)
                return resp
            except RouterError as err:
                status = str(err.status)
                return _error_response(err, request_id)
        except asyncio.CancelledError:
            status = "499"  # the client went away (handler cancellation)
            raise
        finally:  # the orchestrator has aborted whatever a request that ended early touched
            self._active -= 1
            if not self._active:
                self._idle.set()
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(status).inc()
            log.info(
                "request done",
                extra={
                    "request_id": request_id, "status": status, **record.summary(),
                    "seconds": round(time.monotonic() - t0, 4),
                },
            )


def build_app(config: RouterConfig, discovery: Any = None) -> web.Application:
    """The aiohttp application; `discovery` (e.g. KubernetesDiscovery) replaces the static list."""
    router = Router(config, discovery)
    # a little headroom so an oversized body reaches our own 413 rather than aiohttp's
    app = web.Application(middlewares=[openai_errors], client_max_size=config.max_body_bytes + 1)
    app[ROUTER_KEY] = router
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.stop)
    app.router.add_post("/v1/chat/completions", router.chat)
    app.router.add_post("/v1/completions", router.completions)
    app.router.add_get("/v1/models", router.models)
    app.router.add_get("/health", router.health)
    app.router.add_get("/ready", router.ready)
    app.router.add_get("/metrics", router.metrics_endpoint)
    parity_checker.add_routes(app, router)  # GET /internal/parity
    tokenize_api.add_routes(app, router)  # POST /tokenize, /detokenize
    return app
