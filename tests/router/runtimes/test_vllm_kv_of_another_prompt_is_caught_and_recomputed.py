"""A decode server pointed at another prompt's KV does not answer from it (issue 29 item 4).

vLLM's NixlConnector checks nothing of the bytes it reads: if a prefill server's blocks went to
another prompt before a decode server read them (its lease, kv_lease_duration, ran out unheard:
contracts/timing.py says why the router's hand-over stays within it), the read succeeds with the
other prompt's KV. Tandem's guard is the first token: the decode server regenerates it from the KV it
read, and one that is not the prefill's is a HandoffDiverged (router/runtimes/vllm.py); the router
then recomputes the request, and the client gets exactly what colocated vLLM answers.

Here the real router, in this process, is given the wrong KV for its first handoff: the prefill
server computes the prompt (so the client's first token is right) and another prompt of the same
length, and the decode server is pointed at the second one's blocks.

A guard, not a proof: KV that happens to give the same first token passes it, and then the client
does get wrong text. On this toy model the same tokens in reverse order did (the first token
matched, the text after it did not), which is why the wrong KV here is another text's. What keeps
the fault from happening is the lease (contracts/timing.py); the parity probe (HandoffVerified)
checks a pairing's KV over several tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

PROMPT = "Blocks a prefill freed and gave to another prompt must never be decoded as this one's: " * 2
OTHER = "Kubernetes schedules pods onto nodes while an operator reconciles what it has observed; " * 4


async def test_a_decode_pointed_at_another_prompts_kv_never_answers_from_it(vllm_servers, vllm_toy_model_dir,
                                                                           monkeypatch):
    from tandem.router import app as router_app
    from tandem.router.config import RouterConfig

    real_create = router_app.create_client
    swapped: list[str] = []

    def create_client(session, config):
        client = real_create(session, config)
        real_prefill = client.prefill

        async def wrong_blocks_once(url, request):
            if swapped:
                return await real_prefill(url, request)
            result = await real_prefill(url, request)  # the true first token (its blocks left unread)
            n = len(request.prompt_token_ids)
            other_ids = client._tokenizer.encode_prompt(OTHER)[:n]
            assert len(other_ids) == n, "the other prompt must be as long as the request's"
            other = dataclasses.replace(request, prompt_token_ids=other_ids, request_id=request.request_id + "-other")
            swapped.append(request.request_id)
            return dataclasses.replace(result, kv=(await real_prefill(url, other)).kv)  # another prompt's blocks

        client.prefill = wrong_blocks_once
        return client

    monkeypatch.setattr(router_app, "create_client", create_client)
    s = vllm_servers
    config = RouterConfig(runtime="vllm", tokenizer=str(vllm_toy_model_dir), parity_probe=False,
                          prefill=[s.prefill.url], decode=[s.decode.url], internal_secret=s.secret)
    body = {"model": "toy", "prompt": PROMPT, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(s.colocated.url + "/v1/completions", json=body,
                                headers={"Authorization": f"Bearer {s.secret}"}) as r:
            assert r.status == 200, await r.text()
            reference = (await r.json())["choices"][0]["text"]
    async with TestClient(TestServer(router_app.build_app(config))) as http:
        for _ in range(600):
            if (await http.get("/ready")).status == 200:
                break
            await asyncio.sleep(0.1)
        resp = await http.post("/v1/completions", json=body)
        answer = await resp.json()
        metrics = await (await http.get("/metrics")).text()
    assert resp.status == 200, answer
    assert swapped, "the router never prefilled: the wrong KV was not handed over"
    assert answer["choices"][0]["text"] == reference, "the client got text decoded from another prompt's KV"
    assert answer["choices"][0]["finish_reason"] == "length"
    assert "tandem_router_handoffs_diverged_total 1.0" in metrics.splitlines(), "the guard did not fire"
