"""The vllm runtime's client speaks vLLM's disaggregation protocol (issue 29 item 3): a prefill on the
kv_producer server (one token, `do_remote_decode`), then a decode on the kv_consumer server with the
prefill's kv_transfer_params, gives exactly the greedy tokens and text a colocated vLLM server gives
for the same prompt, and the decode server pulled the prompt's KV instead of computing it. Through
a real `tandem router --runtime vllm` too, with the official OpenAI client: completions and chat,
streamed and not, and a seeded sampled request, each identical to the colocated server's answer."""

from __future__ import annotations

import json
import urllib.request
import uuid

import openai
import pytest
from tandem.contracts.names import Role
from tandem.contracts.protocol import EventType, GenerateRequest
from tandem.contracts.sampling import SamplingParams
from tandem.router.tokenizer import RouterTokenizer

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

PROMPTS = [
    "The router sends the prompt to a prefill worker and streams tokens from a decode worker.",
    "Once upon a time there was a little model that wanted to speak every language, " * 3,
    "Café, naïve, über: UTF-8 ",
]
NONCE = uuid.uuid4().hex[:8]  # prompts no server has cached yet, even on a second run against the same servers
EXTERNAL = 'vllm:prompt_tokens_by_source_total{engine="0",model_name="toy",source="external_kv_transfer"}'


def colocated(servers, body: dict) -> dict:
    """vLLM's own answer, from the colocated server."""
    req = urllib.request.Request(servers.colocated.url + "/v1/completions",
                                 json.dumps({"model": "toy"} | body).encode(),
                                 {"Content-Type": "application/json", "Authorization": f"Bearer {servers.secret}"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)["choices"][0]


async def handoff(client, servers, prompt_ids: list[int], sampling: SamplingParams, rid: str
                  ) -> tuple[list[int], str]:
    """Prefill on the prefill server, then decode on the decode server with its KV: every token and
    all the text the client gets."""
    req = GenerateRequest(rid, prompt_token_ids=prompt_ids, sampling=sampling)
    res = await client.prefill(servers.prefill.url, req)
    assert res.prompt_token_ids == prompt_ids and res.finish_reason is None and res.kv is not None
    assert res.kv.backend == "nixl" and res.kv.extra["kv_transfer_params"]["remote_block_ids"]
    tokens, text = [res.first_token_id], res.first_token_text
    req.kv_source, req.generated_token_ids, req.emitted_chars = res.kv, [res.first_token_id], len(text)
    events = [ev async for ev in client.generate(servers.decode.url, req)]
    assert [e.type for e in events][0] is EventType.START and events[0].prompt_tokens == len(prompt_ids)
    assert events[-1].type is EventType.FINISH
    for ev in events:
        tokens += ev.token_ids
        text += ev.text
    assert events[-1].usage == {"prompt_tokens": len(prompt_ids), "completion_tokens": len(tokens)}
    return tokens, text


async def test_prefill_then_decode_is_colocated_vllm_token_for_token(vllm_servers, vllm_client, vllm_toy_model_dir):
    tok = RouterTokenizer.from_dir(vllm_toy_model_dir)
    pulled = vllm_servers.decode.metric(EXTERNAL)
    for i, prompt in enumerate(PROMPTS):
        ids = tok.encode_prompt(f"{NONCE} {prompt}")
        ref = colocated(vllm_servers, {"prompt": ids, "max_tokens": 24, "temperature": 0,
                                                     "return_token_ids": True, "ignore_eos": True})
        tokens, text = await handoff(vllm_client, vllm_servers, ids,
                                     SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), f"greedy-{i}")
        assert tokens == ref["token_ids"] and text == ref["text"], prompt
        now = vllm_servers.decode.metric(EXTERNAL)
        assert now - pulled >= len(ids) - 1, "the decode server computed the prompt instead of pulling its KV"
        pulled = now


async def test_a_seeded_sample_and_penalties_survive_the_handoff(vllm_servers, vllm_client, vllm_toy_model_dir):
    """The decode server samples the first token again from the same logits and seed: the tokens
    after it are the colocated server's, penalties having counted the first token as output."""
    ids = RouterTokenizer.from_dir(vllm_toy_model_dir).encode_prompt(f"{NONCE} {PROMPTS[0]} sampled")
    knobs = {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 1234, "presence_penalty": 0.5,
             "frequency_penalty": 0.3, "repetition_penalty": 1.1}
    ref = colocated(vllm_servers, {"prompt": ids, "max_tokens": 20, "return_token_ids": True,
                                                 "ignore_eos": True} | knobs)
    tokens, text = await handoff(vllm_client, vllm_servers, ids,
                                 SamplingParams(max_tokens=20, ignore_eos=True, **knobs), "seeded")
    assert tokens == ref["token_ids"] and text == ref["text"]


def test_the_router_serves_the_openai_client_as_colocated_vllm_does(vllm_servers, vllm_router):
    api = openai.OpenAI(base_url=vllm_router.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    ref_api = openai.OpenAI(base_url=vllm_servers.colocated.url + "/v1", api_key=vllm_servers.secret, max_retries=0,
                            timeout=300)
    disaggregated = vllm_router.metric('tandem_router_routes_total{route="disaggregated"}')
    for i, prompt in enumerate(PROMPTS):
        prompt = f"{NONCE} {i} {prompt} routed"  # a prompt no server holds yet: the router hands it off
        kw = {"model": "toy", "prompt": prompt, "max_tokens": 16, "temperature": 0}
        ref = ref_api.completions.create(**kw).choices[0].text
        assert api.completions.create(**kw).choices[0].text == ref
        streamed = "".join(c.choices[0].text for c in api.completions.create(**kw | {"prompt": prompt + "!"},
                                                                             stream=True) if c.choices)
        assert streamed == ref_api.completions.create(**kw | {"prompt": prompt + "!"}).choices[0].text
    messages = [{"role": "user", "content": "Hello, how are you today?"}]
    chat = {"model": "toy", "messages": messages, "max_tokens": 16, "temperature": 0}
    assert (api.chat.completions.create(**chat).choices[0].message.content
            == ref_api.chat.completions.create(**chat).choices[0].message.content)
    assert vllm_router.metric('tandem_router_routes_total{route="disaggregated"}') - disaggregated >= 2 * len(PROMPTS)
    assert vllm_router.get_json("/ready")["workers"][Role.PREFILL.value]["ready"] == 1
