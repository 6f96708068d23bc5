"""The handoff parity probe on vLLM (issue 29 item 4). vLLM cannot be forced through given tokens, so
the probe runs the other way round (router/parity/probe.py): prefill on the kv_producer server, then
decode on the kv_consumer server with the KV pulled, greedy, each chosen token's logprob kept; then
the decode server alone scores exactly those tokens after the prompt (`prompt_logprobs`, a cache
salt of its own so none of the pulled KV is reused). A faithful handoff agrees within the dtype's
tolerance; a pairing that moves the wrong KV does not: here the decode server is handed another
prompt's blocks, and the probe says MISMATCH (the first token vLLM regenerates from them is not
the prefill's, or the logprobs differ)."""

from __future__ import annotations

import pytest
from tandem.contracts.handoff_parity import ProbeOutcome
from tandem.contracts.names import Role
from tandem.router.parity.decisions import Pair, tolerance_for
from tandem.router.parity.probe import run_probe
from tandem.router.policies.base import WorkerView
from tandem.router.runtimes.vllm import scored_prompt

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


async def _pair(client, servers) -> Pair:
    views = []
    for role in (Role.PREFILL, Role.DECODE):
        url = getattr(servers, role.value).url
        info = await client.info(url, role)
        views.append(WorkerView(url, role, info.kv_compat, ready=info.ready, dtype=info.dtype,
                                engine_id=info.engine_id))
    return Pair(views[0], views[1], frozenset(v.url for v in views))


async def test_a_real_vllm_pairing_agrees_within_its_dtypes_tolerance(vllm_servers, vllm_client):
    pair = await _pair(vllm_client, vllm_servers)
    tolerance = tolerance_for(pair.decode.dtype)
    results = [await run_probe(vllm_client, pair, tolerance, timeout_s=120, seed=seed) for seed in (1, 2, 3)]
    for r in results:
        assert r.outcome is ProbeOutcome.MATCH, r.message
        assert r.tokens == 8 and r.max_abs_diff is not None and r.max_abs_diff <= tolerance
    print("vLLM parity probe, |logprob difference| by seed:", [r.max_abs_diff for r in results], pair.decode.dtype)


async def test_a_decode_given_another_prompts_kv_is_a_mismatch(vllm_servers, vllm_client, monkeypatch):
    """The fault the probe exists for: the bytes of the wrong blocks. The prefill's answer is swapped
    for that of another prompt of the same length, so the decode server pulls KV that is not its
    prompt's and continues from it; alone, it scores the same tokens after the true prompt."""
    pair = await _pair(vllm_client, vllm_servers)
    real_prefill = vllm_client.prefill

    async def wrong_blocks(url, request):
        other = request.prompt_token_ids[::-1]  # same length and tokens, another order: other KV
        res = await real_prefill(url, type(request)(**{**request.__dict__, "prompt_token_ids": other,
                                                        "request_id": request.request_id + "-other"}))
        res.prompt_token_ids = list(request.prompt_token_ids)
        return res

    monkeypatch.setattr(vllm_client, "prefill", wrong_blocks)
    result = await run_probe(vllm_client, pair, tolerance_for(pair.decode.dtype), timeout_s=120, seed=4)
    assert result.outcome is ProbeOutcome.MISMATCH, result.message
    print("wrong KV:", result.message)


def test_prompt_logprobs_are_read_for_the_prompts_own_tokens_only():
    lps = [None, {"7": {"logprob": -0.5, "rank": 1}}, {"9": {"logprob": -2.0, "rank": 3}, "4": {"logprob": -0.1}}]
    assert scored_prompt(lps, [5, 7, 9], 2) == [(7, -0.5), (9, -2.0)]
    with pytest.raises(ValueError, match="own token 9"):
        scored_prompt(lps[:2] + [{"4": {"logprob": -0.1}}], [5, 7, 9], 2)
    with pytest.raises(ValueError, match="for 2 tokens"):
        scored_prompt(lps[:2], [5, 7, 9], 2)
