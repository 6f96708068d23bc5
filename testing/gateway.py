"""A small data plane that speaks the endpoint picker protocol as Envoy does, for the tests and the
bench: no Envoy can be built here, so this is the gateway side of contracts/gateway.py, written from
the protocol (the ext_proc messages are Envoy's own, from the `xds-protos` package).

For each HTTP request it opens one ext_proc stream to the picker (full-duplex streamed body mode, the
extension's), sends the headers and the whole body (and, when given, the pool subset in the filter
metadata), and follows the answer: an immediate response goes back to the client as it is; otherwise
the request, with the picker's header mutations applied and its body as the picker handed it back,
goes to the endpoint the picker named (the header and the `envoy.lb` metadata must agree). The
response headers go to the picker with the endpoint that served them, and the body streams to the
client. When the picker cannot be reached: FailOpen sends the request to a pool endpoint by turns,
FailClose answers 503.

Not part of the protocol, for the tests: every response carries `x-gateway-destination-endpoint-served`
(which pool endpoint served it, or "" when the gateway answered itself).

    python -m tandem.testing.gateway --picker HOST:PORT --endpoint HOST:PORT ... --port P
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import sys

import aiohttp
import grpc
from aiohttp import web
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import struct_pb2
from tandem.contracts import gateway
from tandem.worker.local.processes import ManagedProcess, free_port

log = logging.getLogger("tandem.testing.gateway")
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.BodySendMode.FULL_DUPLEX_STREAMED
_HOP = {"host", "content-length", "transfer-encoding", "connection"}


class PickerUnavailable(Exception):
    """The ext_proc stream could not be opened or broke before an answer."""


def _header_map(headers: dict[str, str]) -> ep.HttpHeaders:
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()])


def _metadata(namespace: str, key: str, value: str | list[str]) -> base_pb2.Metadata:
    inner = struct_pb2.Struct()
    if isinstance(value, list):
        inner.get_or_create_list(key).extend(value)
    else:
        inner[key] = value
    md = base_pb2.Metadata()
    md.filter_metadata[namespace].CopyFrom(inner)
    return md


def _apply(mutation: ep.HeaderMutation, headers: dict[str, str]) -> None:
    for option in mutation.set_headers:
        h = option.header
        headers[h.key.lower()] = h.raw_value.decode() if h.raw_value else h.value
    for name in mutation.remove_headers:
        headers.pop(name.lower(), None)


class Gateway:
    def __init__(self, picker: str | None, pool: list[str], failure_mode: str = "FailOpen",
                 subset: list[str] | None = None) -> None:
        self.picker, self.pool, self.failure_mode, self.subset = picker, pool, failure_mode, subset
        self._turns = itertools.cycle(pool)
        self.channel: grpc.aio.Channel | None = None
        self.session: aiohttp.ClientSession | None = None

    async def start(self, app: web.Application) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        if self.picker:
            self.channel = grpc.aio.insecure_channel(self.picker)

    async def stop(self, app: web.Application) -> None:
        if self.channel is not None:
            await self.channel.close()
        if self.session is not None:
            await self.session.close()

    async def _ask(self, call: grpc.aio.StreamStreamCall, headers: dict[str, str], body: bytes
                   ) -> tuple[str | None, ep.ProcessingResponse | None, bytes]:
        """Headers and body to the picker; (destination, immediate response, body to send)."""
        first = ep.ProcessingRequest(
            request_headers=ep.HttpHeaders(headers=_header_map(headers), end_of_stream=not body),
            protocol_config=ep.ProtocolConfiguration(request_body_mode=FULL_DUPLEX))
        if self.subset is not None:
            first.metadata_context.CopyFrom(_metadata(gateway.SUBSET_NAMESPACE, gateway.SUBSET_KEY, self.subset))
        await call.write(first)
        if body:
            await call.write(ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True)))
        destination, sent = None, bytearray()
        while True:
            msg = await call.read()
            if msg is grpc.aio.EOF:
                raise PickerUnavailable("the picker closed the stream without an answer")
            kind = msg.WhichOneof("response")
            if kind == "immediate_response":
                return None, msg, b""
            if kind == "request_headers":
                _apply(msg.request_headers.response.header_mutation, headers)
                destination = headers.get(gateway.DESTINATION_HEADER)
                lb = msg.dynamic_metadata.fields.get(gateway.LB_NAMESPACE)
                meta = lb.struct_value.fields[gateway.DESTINATION_HEADER].string_value if lb else None
                if meta != destination:
                    raise PickerUnavailable(f"the picker's header ({destination}) and metadata ({meta}) differ")
                if not body:
                    return destination, None, b""
            elif kind == "request_body":
                streamed = msg.request_body.response.body_mutation.streamed_response
                sent += streamed.body
                if streamed.end_of_stream:
                    return destination, None, bytes(sent)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        body = await request.read()
        headers = {k.lower(): v for k, v in request.headers.items() if k.lower() not in _HOP}
        headers.update({":path": request.path_qs, ":method": request.method, ":authority": request.host})
        call = None
        try:
            if self.channel is None:
                raise PickerUnavailable("no picker")
            call = ep_grpc.ExternalProcessorStub(self.channel).Process()
            destination, refused, body = await asyncio.wait_for(self._ask(call, headers, body), 60)
        except (PickerUnavailable, grpc.aio.AioRpcError, TimeoutError) as exc:
            if call is not None:
                call.cancel()
            call = None
            if self.failure_mode != "FailOpen" or not self.pool:
                return web.json_response({"error": {"message": f"endpoint picker unavailable: {exc}"}},
                                         status=503, headers={gateway.SERVED_KEY: ""})
            destination, refused = next(self._turns), None
        if refused is not None:
            r = refused.immediate_response
            out = {h.header.key: h.header.raw_value.decode() for h in r.headers.set_headers}
            out[gateway.SERVED_KEY] = ""
            await call.done_writing()
            return web.Response(status=r.status.code, body=r.body, headers=out)
        endpoint = gateway.parse_endpoints(destination)[0]
        upstream = {k: v for k, v in headers.items() if not k.startswith(":")}
        try:
            async with self.session.request(request.method, f"http://{endpoint}{request.path_qs}",
                                            data=body, headers=upstream) as up:
                if call is not None:
                    await call.write(ep.ProcessingRequest(
                        response_headers=ep.HttpHeaders(headers=_header_map({":status": str(up.status)})),
                        metadata_context=_metadata(gateway.LB_NAMESPACE, gateway.SERVED_KEY, endpoint)))
                    await call.read()
                resp = web.StreamResponse(status=up.status, headers={
                    **{k: v for k, v in up.headers.items() if k.lower() not in _HOP}, gateway.SERVED_KEY: endpoint})
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        finally:
            if call is not None:
                await call.done_writing()
                call.cancel()


def build_app(gw: Gateway) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.on_startup.append(gw.start)
    app.on_cleanup.append(gw.stop)
    app.router.add_get("/healthz", lambda r: web.json_response({"status": "ok"}))
    app.router.add_route("*", "/{tail:.*}", gw.handle)
    return app


class GatewayProcess(ManagedProcess):
    """`python -m tandem.testing.gateway` on a loopback port; `start()` returns once it answers."""

    ready_path = "/healthz"

    def __init__(self, picker: str | None, pool: list[str], failure_mode: str = "FailOpen",
                 subset: list[str] | None = None) -> None:
        self.port = free_port()
        argv = [sys.executable, "-m", "tandem.testing.gateway", "--port", str(self.port),
                "--failure-mode", failure_mode, *[a for e in pool for a in ("--endpoint", e)]]
        if picker:
            argv += ["--picker", picker]
        if subset is not None:
            argv += ["--subset", ",".join(subset)]
        super().__init__("gateway", argv, url=f"http://127.0.0.1:{self.port}", role="gateway")

    def start(self, timeout_s: float = 30.0) -> GatewayProcess:
        super().start()
        self.wait_ready(self.ready_path, timeout_s)
        return self

    def __enter__(self) -> GatewayProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--picker", default=None, help="the endpoint picker's gRPC address HOST:PORT")
    p.add_argument("--endpoint", action="append", default=[], help="a pool endpoint HOST:PORT (repeatable)")
    p.add_argument("--failure-mode", choices=("FailOpen", "FailClose"), default="FailOpen")
    p.add_argument("--subset", default=None, help="endpoints the picker may choose from (comma-separated)")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    subset = gateway.parse_endpoints(a.subset) if a.subset is not None else None
    web.run_app(build_app(Gateway(a.picker, a.endpoint, a.failure_mode, subset)), host="127.0.0.1",
                port=a.port, access_log=None)


if __name__ == "__main__":
    main()
