"""A vLLM prefill and decode server started by Tandem's launcher, driven with vLLM's own
disaggregation protocol (prefill: one token with `do_remote_decode`; decode: the
`kv_transfer_params` the prefill answered), answer greedily exactly what one colocated vLLM
server does, and the decode server computes none of the prompt: every prompt token arrives by
NIXL (its `vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

# Distinct prompts (no shared prefix with each other or the other tests'), several KV blocks each
# and one ending mid-block, so the transfer covers full and partial blocks.
PROMPTS = [
    "Prefill reads the whole prompt at once; decode writes one token at a time. " * 5,
    "Kubernetes schedules pods onto nodes, and an operator reconciles what it observes, " * 3 + "then",
]
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}


def _completion(prompt: str, max_tokens: int, **extra: object) -> dict:
    return {"model": "toy", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **extra}


def _sources(servers, role: str) -> dict[str, float]:
    """Where the server's prompt tokens came from so far."""
    return {s: servers.metric(role, "vllm:prompt_tokens_by_source_total", source=s)
            for s in ("external_kv_transfer", "local_compute", "local_cache_hit")}


@pytest.mark.parametrize("prompt", PROMPTS, ids=["whole-blocks-and-a-tail", "ends-mid-block"])
def test_decode_of_a_remote_prefill_equals_colocated_and_transfers_every_prompt_token(
        vllm_servers, prompt: str) -> None:
    servers = vllm_servers
    before = _sources(servers, "decode")

    first = servers.post("prefill", "/v1/completions", _completion(prompt, 1, kv_transfer_params=REMOTE_DECODE))
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_block_ids"], params
    answer = servers.post("decode", "/v1/completions", _completion(prompt, 32, kv_transfer_params=params))
    reference = servers.post("colocated", "/v1/completions", _completion(prompt, 32))

    assert answer["choices"][0]["text"] == reference["choices"][0]["text"]
    assert answer["usage"]["completion_tokens"] == 32
    prompt_tokens = answer["usage"]["prompt_tokens"]
    assert prompt_tokens == reference["usage"]["prompt_tokens"] == params["remote_num_tokens"]
    after = _sources(servers, "decode")
    assert after["external_kv_transfer"] - before["external_kv_transfer"] == prompt_tokens
    assert after["local_compute"] == before["local_compute"] and after["local_cache_hit"] == before["local_cache_hit"]
    assert servers.metric("decode", "vllm:nixl_num_failed_transfers_total") == 0
