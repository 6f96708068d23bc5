"""What the vllm runtime cannot do is refused, never ignored (issue 29 item 3): teacher forcing (the
parity probe's `forced_token_ids`, which vLLM's completions cannot take) is a 400 naming the field
before any server computes, and what vLLM itself refuses reaches the client as the router's own 400
(OpenAI's shape, `invalid_request_error`, the parameter named), before a stream starts."""

from __future__ import annotations

import openai
import pytest
from tandem.contracts.protocol import GenerateRequest
from tandem.contracts.sampling import SamplingParams
from tandem.router.errors import RouterError

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


async def test_teacher_forcing_is_refused_naming_the_field(vllm_servers, vllm_client):
    req = GenerateRequest("forced", prompt_token_ids=[5, 6, 7],
                          sampling=SamplingParams(max_tokens=2, forced_token_ids=[8, 9]))
    for call in (vllm_client.prefill(vllm_servers.prefill.url, req), anext(vllm_client.generate(
            vllm_servers.decode.url, req))):
        with pytest.raises(RouterError) as refused:
            await call
        assert refused.value.status == 400
        assert refused.value.body["error"]["param"] == "forced_token_ids"
        assert "--no-parity-probe" in refused.value.message


def test_what_vllm_refuses_is_the_routers_400_before_the_stream(vllm_router):
    api = openai.OpenAI(base_url=vllm_router.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            api.completions.create(model="toy", prompt="Hello there, general", max_tokens=4, stream=stream,
                                   logit_bias={"999999": 5})  # no such token in the toy vocabulary
        err = refused.value.body if isinstance(refused.value.body, dict) else {}
        assert refused.value.status_code == 400
        assert err.get("type") == "invalid_request_error" and err.get("param") == "logit_bias", err
        assert "999999" in err.get("message", "")
