"""The endpoint picker: Tandem's router as a Gateway API Inference Extension endpoint picker, an Envoy
`ext_proc` server over gRPC (`--ext-proc-port`; the protocol: contracts/gateway.py).

For each request the gateway streams its headers and body here. The picker reads the body as the
router does (the same 4xx for a bad request, the same tokenization), takes its turn at flow control,
and routes it with the router's own policy over the router's own worker set (load, prefix, pairing,
the parity probe, conditional disaggregation). Its answer names the decode pod (its sidecar's
endpoint: `x-gateway-destination-endpoint`, and the same value in the `envoy.lb` dynamic metadata)
and, for a handoff, the prefill worker (`x-gateway-prefill-endpoints`). Nothing eligible is a 503,
a refusal by flow control a 429 with Retry-After, both as an immediate response in OpenAI's format.

The request counts on the workers it was sent to (as the router's own requests do) until the gateway
closes the stream; the prefill's prompt tokens until the response starts (the decode side answers
only once its prompt is computed). The turn at flow control is held as long. On the response the
gateway says which endpoint served it (`x-gateway-destination-endpoint-served`), counted in
`tandem_router_picker_served_total{followed}`.

Body modes: FULL_DUPLEX_STREAMED (the extension's: the picker answers the headers once the body is
whole, then hands the body back) and BUFFERED (headers continue, the body's answer carries the pick).
Under NONE or STREAMED the body comes after the route is fixed, so the pick is made from the headers
alone (any ready decode worker by load, no handoff).

Health (gRPC health protocol): `liveness` SERVING while the process runs; `readiness` and the
ext_proc service SERVING while this replica leads (or runs alone) and some worker can serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from tandem.contracts import gateway
from tandem.contracts.json_body import BodyError, decode_json
from tandem.contracts.names import Role
from tandem.router.errors import RouterError, no_worker
from tandem.router.journey import Charge, request_info
from tandem.router.policies.base import RequestInfo, Route
from tandem.router.validation import Endpoint, check_model, parse_request

if TYPE_CHECKING:
    from tandem.router.app import Router

log = logging.getLogger("tandem.router.picker")

BodyMode = processing_mode_pb2.ProcessingMode.BodySendMode
_WHOLE_BODY = (BodyMode.FULL_DUPLEX_STREAMED, BodyMode.BUFFERED)
_PATHS = {"/v1/chat/completions": Endpoint.CHAT, "/v1/completions": Endpoint.COMPLETION}


@dataclass(frozen=True)
class Pick:
    """Where one request goes: the decode pod's endpoint, the prefill worker's (None: decode prefills)."""

    decode: str
    prefill: str | None
    route: Route


def headers_of(msg: ep.HttpHeaders) -> dict[str, str]:
    """An ext_proc header map as a dict with lower-case names (Envoy sends raw_value, older ones value)."""
    return {h.key.lower(): (h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value)
            for h in msg.headers.headers}


def metadata_value(metadata: base_pb2.Metadata, namespace: str, key: str) -> Any:
    """`filter_metadata[namespace][key]` as plain Python (None when absent)."""
    if namespace not in metadata.filter_metadata:
        return None
    fields = metadata.filter_metadata[namespace].fields
    if key not in fields:
        return None
    value = fields[key]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return [v.string_value for v in value.list_value.values]
    return value.string_value if kind == "string_value" else None


def subset_of(msg: ep.ProcessingRequest) -> set[str] | None:
    """The endpoints the data plane allows (`envoy.lb.subset_hint`), None when it names no subset."""
    value = metadata_value(msg.metadata_context, gateway.SUBSET_NAMESPACE, gateway.SUBSET_KEY)
    if value is None:
        return None
    return set(gateway.parse_endpoints(",".join(value) if isinstance(value, list) else value))


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def routed(pick: Pick) -> tuple[ep.CommonResponse, struct_pb2.Struct]:
    """The pick as a header mutation (the destination, the prefill endpoint, or the latter removed so
    a client cannot name one) and as `envoy.lb` dynamic metadata (the same destination)."""
    mutation = ep.HeaderMutation(set_headers=[_header(gateway.DESTINATION_HEADER, pick.decode)])
    if pick.prefill is not None:
        mutation.set_headers.append(_header(gateway.PREFILL_HEADER, pick.prefill))
    else:
        mutation.remove_headers.append(gateway.PREFILL_HEADER)
    metadata = struct_pb2.Struct()
    metadata.get_or_create_struct(gateway.LB_NAMESPACE)[gateway.DESTINATION_HEADER] = pick.decode
    return ep.CommonResponse(header_mutation=mutation, clear_route_cache=True), metadata


def immediate(err: RouterError, request_id: str) -> ep.ProcessingResponse:
    """A 4xx/5xx the gateway answers at once, in OpenAI's error format."""
    headers = {"content-type": "application/json", "x-request-id": request_id, **err.headers}
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=err.status),
        headers=ep.HeaderMutation(set_headers=[_header(k.lower(), str(v)) for k, v in headers.items()]),
        body=json.dumps(err.body).encode(), details=err.body["error"]["message"][:200]))


class Picker(ep_grpc.ExternalProcessorServicer):
    """The ext_proc service over one Router (its config, workers, policy, tokenizer, flow control)."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.endpoints = dict(router.config.gateway_endpoints)

    # --- where each worker is reached through the gateway ----------------------------------------

    def decode_endpoint(self, url: str) -> str:
        """A decode worker's pod as the gateway names it: its sidecar (`gateway_endpoints`, else the
        worker's host at `gateway_port`, else the worker itself)."""
        url = url.rstrip("/")
        if url in self.endpoints:
            return self.endpoints[url]
        endpoint = gateway.endpoint_of(url)
        port = self.router.config.gateway_port
        return f"{endpoint.rpartition(':')[0]}:{port}" if port else endpoint

    # --- one request ----------------------------------------------------------------------------

    async def _parse(self, headers: Mapping[str, str], body: bytes | None) -> RequestInfo:
        """What the policy sees of the request; RouterError (a 4xx) for a bad one, as the router says it."""
        r = self.router
        request_id = headers.get("x-request-id") or uuid.uuid4().hex
        endpoint = _PATHS.get(headers.get(":path", "").partition("?")[0])
        if endpoint is None or body is None:  # not a generation (or its body is not ours to read)
            return RequestInfo(request_id, 0)
        if len(body) > r.config.max_body_bytes:
            raise RouterError(413, f"The request body is larger than this server accepts "
                              f"({r.config.max_body_bytes} bytes).", "invalid_request_error", None,
                              "request_too_large")
        try:
            raw = decode_json(body, headers.get("content-type"))
        except BodyError as exc:
            raise RouterError(exc.status, str(exc), "invalid_request_error", exc.param, exc.code) from None
        parsed = parse_request(raw, endpoint, r.limits)
        served = r.workers.model() if r.workers is not None else None
        if served is None:
            raise no_worker("no worker is ready yet; retry shortly.")
        check_model(parsed.model, served)
        await r.tokenize(parsed)
        return request_info(parsed, request_id)

    def _route(self, info: RequestInfo, subset: set[str] | None, handoff: bool) -> Pick:
        """The policy's route over the workers the data plane allows (a subset names decode pods)."""
        r = self.router
        assert r.workers is not None and r.orchestrator is not None
        snap = r.workers.snapshot(info)
        if subset is not None:
            snap = snap.among(w for w in snap.workers
                              if w.role is Role.PREFILL or self.decode_endpoint(w.url) in subset)
        if not handoff:
            snap = snap.among(w for w in snap.workers if w.role is not Role.PREFILL)
        route = r.orchestrator.policy.route(info, snap) if any(w.ready for w in snap.workers) else None
        if route is None:
            why = "none of the endpoints the gateway allows" if subset is not None else "no worker"
            raise no_worker(f"{why} is ready to serve this request; retry shortly.")
        r.workers.took_turns((Role.PREFILL, Role.DECODE) if route.prefill is not None else (Role.DECODE,))
        prefill = gateway.endpoint_of(route.prefill.url) if route.prefill is not None else None
        return Pick(self.decode_endpoint(route.decode.url), prefill, route)

    def _charge(self, request_id: str, pick: Pick, info: RequestInfo, prefilling: bool) -> None:
        """What the request counts on its workers until their polls show it (as the router's own)."""
        assert self.router.workers is not None
        handoff = pick.route.prefill is not None and prefilling
        charges = {pick.route.decode.url: Charge(planned=1) if handoff else Charge(inflight=1)}
        if handoff:
            charges[pick.route.prefill.url] = Charge(1, info.prompt_tokens - pick.route.cached_prefill_tokens)
        self.router.workers.account(request_id, charges)

    async def _decide(self, headers: Mapping[str, str], body: bytes | None, subset: set[str] | None,
                      turn: contextlib.AsyncExitStack) -> tuple[Pick, RequestInfo]:
        """Read, admit (the turn held on `turn` until the stream ends) and route one request."""
        t0 = time.monotonic()
        info = await self._parse(headers, body)
        self.router.check_auth(headers)
        await turn.enter_async_context(self.router.turn(self.router.flow_key(headers)))
        pick = self._route(info, subset, handoff=body is not None)
        self._charge(info.request_id, pick, info, prefilling=True)
        self.router.metrics.picker_picks.labels(pick.route.reason.value).inc()
        self.router.metrics.picker_seconds.observe(time.monotonic() - t0)
        return pick, info

    async def Process(self, request_iterator: AsyncIterator[ep.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[ep.ProcessingResponse]:
        r = self.router
        mode = BodyMode.NONE
        headers: dict[str, str] = {}
        body = bytearray()
        subset: set[str] | None = None
        pick: Pick | None = None
        info: RequestInfo | None = None
        async with contextlib.AsyncExitStack() as turn:
            try:
                async for msg in request_iterator:
                    if msg.HasField("protocol_config"):
                        mode = msg.protocol_config.request_body_mode
                    kind = msg.WhichOneof("request")
                    if kind == "request_headers":
                        headers = headers_of(msg.request_headers)
                        subset = subset_of(msg)
                        whole = mode in _WHOLE_BODY and not msg.request_headers.end_of_stream
                        if whole and mode == BodyMode.FULL_DUPLEX_STREAMED:
                            continue  # answered with the pick once the body is whole
                        if whole:  # BUFFERED: the body follows this answer, its answer carries the pick
                            yield ep.ProcessingResponse(request_headers=ep.HeadersResponse())
                            continue
                        pick, info = await self._decide(headers, None, subset, turn)
                        common, metadata = routed(pick)
                        yield ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common),
                                                    dynamic_metadata=metadata)
                    elif kind == "request_body":
                        if pick is not None:  # picked at the headers (NONE/STREAMED): pass it on
                            yield self._pass_body(mode, msg.request_body)
                            continue
                        body += msg.request_body.body
                        if not msg.request_body.end_of_stream:
                            continue
                        pick, info = await self._decide(headers, bytes(body), subset, turn)
                        common, metadata = routed(pick)
                        if mode == BodyMode.FULL_DUPLEX_STREAMED:
                            yield ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common),
                                                        dynamic_metadata=metadata)
                            yield ep.ProcessingResponse(request_body=ep.BodyResponse(response=ep.CommonResponse(
                                body_mutation=ep.BodyMutation(streamed_response=ep.StreamedBodyResponse(
                                    body=bytes(body), end_of_stream=True)))))
                        else:
                            yield ep.ProcessingResponse(request_body=ep.BodyResponse(response=common),
                                                        dynamic_metadata=metadata)
                    elif kind in ("request_trailers", "response_headers", "response_body", "response_trailers"):
                        yield self._after_pick(msg, kind, mode, pick, info)
            except RouterError as err:
                r.metrics.picker_refused.labels(str(err.status)).inc()
                yield immediate(err, headers.get("x-request-id") or uuid.uuid4().hex)
            finally:
                if info is not None and r.workers is not None:
                    r.workers.account(info.request_id, {})

    def _after_pick(self, msg: ep.ProcessingRequest, kind: str, mode: int, pick: Pick | None,
                    info: RequestInfo | None) -> ep.ProcessingResponse:
        """The answer to trailers and to the response's parts: the served endpoint counted, the
        prefill's prompt no longer charged once the response starts, bodies handed back."""
        if kind == "request_trailers":
            return ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
        if kind == "response_headers":
            served = metadata_value(msg.metadata_context, gateway.LB_NAMESPACE, gateway.SERVED_KEY)
            if pick is not None and served:
                followed = str(served in gateway.parse_endpoints(pick.decode)).lower()
                self.router.metrics.picker_served.labels(followed).inc()
            if pick is not None and info is not None:
                self._charge(info.request_id, pick, info, prefilling=False)
            return ep.ProcessingResponse(response_headers=ep.HeadersResponse())
        if kind == "response_body":
            body_mode = msg.protocol_config.response_body_mode if msg.HasField("protocol_config") else mode
            return self._pass_body(body_mode, msg.response_body, response=True)
        return ep.ProcessingResponse(response_trailers=ep.TrailersResponse())

    @staticmethod
    def _pass_body(mode: int, body: ep.HttpBody, response: bool = False) -> ep.ProcessingResponse:
        """A body chunk handed back unchanged (in full duplex, the picker sends the body on itself)."""
        if mode == BodyMode.FULL_DUPLEX_STREAMED:
            common = ep.CommonResponse(body_mutation=ep.BodyMutation(streamed_response=ep.StreamedBodyResponse(
                body=body.body, end_of_stream=body.end_of_stream)))
        else:
            common = ep.CommonResponse()
        answer = ep.BodyResponse(response=common)
        return ep.ProcessingResponse(response_body=answer) if response else ep.ProcessingResponse(request_body=answer)


class PickerServer:
    """The gRPC server: ext_proc and health, on `host:port`; `leading` says whether this replica may
    serve (always, without leader election)."""

    def __init__(self, router: Router, host: str, port: int) -> None:
        self.router = router
        self.address = f"{host}:{port}"
        self.health = health.aio.HealthServicer()
        self.leading = True
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._watch: asyncio.Task | None = None

    async def start(self) -> None:
        self._server = grpc.aio.server()
        ep_grpc.add_ExternalProcessorServicer_to_server(Picker(self.router), self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        self.port = self._server.add_insecure_port(self.address)
        await self._server.start()
        await self.health.set(gateway.HEALTH_LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        await self.refresh()
        self._watch = asyncio.create_task(self._keep_health())
        log.info("endpoint picker (ext_proc) listening on %s", self.address)

    async def refresh(self) -> None:
        """Readiness and the ext_proc service: serving while this replica leads and a worker can serve."""
        workers = self.router.workers
        ok = self.leading and workers is not None and workers.can_serve() and not self.router.draining
        status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in (gateway.HEALTH_READINESS, gateway.EXT_PROC_SERVICE, ""):
            await self.health.set(service, status)

    async def _keep_health(self) -> None:
        while True:
            await asyncio.sleep(self.router.config.poll_interval_s)
            try:
                await self.refresh()
            except Exception:  # a health update must never end the loop
                log.exception("updating the picker's health")

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        if self._server is not None:
            await self.health.enter_graceful_shutdown()
            await self._server.stop(grace=1.0)
