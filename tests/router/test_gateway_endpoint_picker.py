"""Tandem behind a gateway that speaks the endpoint picker protocol (contracts/gateway.py).

The data plane is tandem.testing.gateway (Envoy's ext_proc messages from `xds-protos`; no Envoy can be
built here). Real workers of the toy model: one prefill, two decode. The picker is `tandem router
--ext-proc-port` over all three; each decode worker has its sidecar (`tandem router --gateway-decode`, the prefill workers by DNS),
and the gateway's pool is the two sidecars, as an InferencePool of the decode pods would be.

The conformance cases of the protocol each have a test: the gateway follows the picker's choice (the
endpoint that served is the one picked; the prefill worker it named computed the prompt), the picker
reads which endpoint served (`x-gateway-destination-endpoint-served`), a subset is honoured (and an
empty one is a 503), and with the picker gone FailOpen still serves while FailClose refuses.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tandem.contracts import gateway
from tandem.contracts.internal_auth import SECRET_ENV
from tandem.testing.gateway import GatewayProcess
from tandem.testing.local_stack import LocalStack
from tandem.testing.router_process import RouterProcess
from tandem.testing.scraped import scrape, value
from tandem.worker.local.processes import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPT = "Kubernetes schedules pods onto nodes, and an operator reconciles what it observes. " * 3


@pytest.fixture(scope="module")
def pool(toy_model_dir: Path):
    """(stack, picker, sidecars by decode worker URL, picker's gRPC address) over one prefill and two
    decode workers of a `tandem up` stack, whose own router is the reference."""
    stack = LocalStack(toy_model_dir, "disaggregated", ["--kv-backend", "tcp", "--decode", "2"])
    with stack:
        env = {**os.environ, SECRET_ENV: stack.secret}
        prefill = [w["url"] for w in stack.workers("prefill")]
        decode = [w["url"] for w in stack.workers("decode")]
        targets = [a for u in prefill for a in ("--prefill", u)] + [a for u in decode for a in ("--decode", u)]
        sidecars, procs = {}, []
        try:
            (prefill_port,) = {int(u.rpartition(":")[2]) for u in prefill}
            for url in decode:  # as in a decode pod: the prefill workers by DNS, no API access
                s = RouterProcess("--gateway-decode", url, "--prefill-dns", f"localhost:{prefill_port}",
                                  "--no-parity-probe", env=env).start()
                procs.append(s)
                sidecars[url] = s
            grpc_port = free_port()
            picker = RouterProcess(*targets, "--ext-proc-port", str(grpc_port),
                                   *[a for u, s in sidecars.items() for a in ("--gateway-endpoint", f"{u}=127.0.0.1:{s.port}")],
                                   env=env).start()
            procs.append(picker)
            yield stack, picker, sidecars, f"127.0.0.1:{grpc_port}"
        finally:
            for p in procs:
                p.stop()


def _endpoints(sidecars: dict) -> list[str]:
    return [f"127.0.0.1:{s.port}" for s in sidecars.values()]


def _client(gw: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _count(url: str, name: str, **labels: str) -> float:
    return value(scrape(url + "/metrics"), name, **labels)


def test_a_request_through_the_picker_streams_the_routers_text(pool, toy_model_dir):
    stack, picker, sidecars, address = pool
    kw = dict(model=toy_model_dir.name, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    reference = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0).completions.create(**kw)

    def one(_: int) -> tuple[str, str]:
        raw = _client(gw).completions.with_raw_response.create(**kw, stream=True)
        return raw.headers[gateway.SERVED_KEY], "".join(c.choices[0].text for c in raw.parse() if c.choices)

    with GatewayProcess(address, _endpoints(sidecars)).start() as gw, ThreadPoolExecutor(4) as pool_:
        served, texts = zip(*pool_.map(one, range(4)), strict=True)
    assert list(texts) == [reference.choices[0].text] * 4
    # at once, the picker spread them over both decode pods (it counts what it sent until the end)
    assert set(served) == set(_endpoints(sidecars))
    # every one went prefill -> KV -> decode, as the picker chose, and the gateway said it followed
    assert _count(picker.url, "tandem_router_picker_picks_total", route="disaggregated") >= 4
    assert _count(picker.url, "tandem_router_picker_served_total", followed="true") >= 4
    assert _count(picker.url, "tandem_router_picker_served_total", followed="false") == 0
    handed = sum(_count(s.url, "tandem_router_worker_requests_total", role="prefill") for s in sidecars.values())
    assert handed >= 4


def test_the_gateway_follows_the_pick_within_a_subset(pool, toy_model_dir):
    stack, picker, sidecars, address = pool
    (first_url, first), (_, second) = list(sidecars.items())
    only = f"127.0.0.1:{second.port}"
    kw = dict(model=toy_model_dir.name, prompt=PROMPT, max_tokens=8, temperature=0)
    with GatewayProcess(address, _endpoints(sidecars), subset=[only]).start() as gw:
        for _ in range(3):
            raw = _client(gw).completions.with_raw_response.create(**kw)
            assert raw.headers[gateway.SERVED_KEY] == only
    with GatewayProcess(address, _endpoints(sidecars), subset=[]).start() as gw:
        with pytest.raises(openai.APIStatusError) as e:
            _client(gw).completions.create(**kw)
    assert e.value.status_code == 503 and e.value.response.headers[gateway.SERVED_KEY] == ""


def test_the_picker_refuses_a_bad_request_as_the_router_does(pool):
    _, _, sidecars, address = pool
    with GatewayProcess(address, _endpoints(sidecars)).start() as gw:
        req = urllib.request.Request(gw.url + "/v1/completions", data=b'{"prompt": "hi", "max_tokens": -3}',
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
    body = json.loads(e.value.read())
    assert e.value.code == 400 and body["error"]["type"] == "invalid_request_error"
    assert e.value.headers[gateway.SERVED_KEY] == ""  # answered by the picker, no worker touched


def test_picker_health_follows_its_workers(pool):
    _, _, _, address = pool
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service in (gateway.HEALTH_LIVENESS, gateway.HEALTH_READINESS, gateway.EXT_PROC_SERVICE):
            assert stub.Check(health_pb2.HealthCheckRequest(service=service)).status == \
                health_pb2.HealthCheckResponse.SERVING


def test_without_the_picker_fail_open_serves_and_fail_close_refuses(pool, toy_model_dir):
    _, _, sidecars, _ = pool
    gone = f"127.0.0.1:{free_port()}"  # nothing listens there
    kw = dict(model=toy_model_dir.name, prompt=PROMPT, max_tokens=8, temperature=0)
    with GatewayProcess(gone, _endpoints(sidecars), "FailOpen").start() as gw:
        raw = _client(gw).completions.with_raw_response.create(**kw)
        assert raw.headers[gateway.SERVED_KEY] in _endpoints(sidecars)
        assert raw.parse().choices[0].text  # the sidecar's own worker prefilled and decoded it
    with GatewayProcess(gone, _endpoints(sidecars), "FailClose").start() as gw:
        with pytest.raises(openai.APIStatusError) as e:
            _client(gw).completions.create(**kw)
        assert e.value.status_code == 503
