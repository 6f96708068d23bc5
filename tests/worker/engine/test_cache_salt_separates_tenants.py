"""The prefix cache as a timing side channel between tenants is closed by a per-tenant salt
(issue 21, defect 13; vLLM's `cache_salt`): a request reuses cached KV only of requests with the
same `cache_salt` (and unsalted ones only of unsalted ones), so a tenant cannot learn whether
another sent a prompt by how fast its own copy of it starts; the output never depends on it; the
router names a salted prompt's blocks as the worker does (contracts/prefix.request_salt)."""

from __future__ import annotations

import pytest
from tandem.contracts.prefix import block_hashes, request_salt
from tandem.contracts.protocol import GenerateRequest
from tandem.testing.engine_helpers import greedy, run_to_completion, tokens_of
from tandem.worker.engine.errors import RequestError

BS = 16
PROMPT = [0] + list(range(100, 147))  # 48 tokens: three full blocks


def _run(eng, rid: str, salt: str | None) -> tuple[list[int], int]:
    """(its tokens, the prompt tokens it found cached)"""
    before = eng.prefix_cache.stats.hit_tokens_total
    seq = eng.make_sequence(GenerateRequest(request_id=rid, prompt_token_ids=PROMPT, sampling=greedy(4),
                                            cache_salt=salt))
    outs: list = []
    seq.sink = outs.append
    eng.add(seq)
    run_to_completion(eng)
    return tokens_of(outs), eng.prefix_cache.stats.hit_tokens_total - before


def test_only_requests_with_the_same_salt_share_cached_blocks(make_engine):
    eng = make_engine(block_size=BS)
    first, hit = _run(eng, "a1", "tenant-a")
    assert hit == 0
    assert _run(eng, "b1", "tenant-b") == (first, 0), "another tenant's salt finds nothing"
    assert _run(eng, "u1", None) == (first, 0), "an unsalted request finds nothing salted"
    assert _run(eng, "a2", "tenant-a") == (first, 2 * BS), "the same tenant reuses its blocks"
    assert _run(eng, "u2", None) == (first, 2 * BS), "unsalted requests share among themselves"


def test_the_router_names_a_salted_prompt_s_blocks_as_the_engine_does(make_engine):
    eng = make_engine(block_size=BS)
    _run(eng, "a", "tenant-a")
    held = set(eng.cached_block_hashes())
    salted = block_hashes(PROMPT, BS, request_salt(eng.prefix_hash_salt, "tenant-a"))
    assert salted[:2] and set(salted[:2]) <= held
    assert not set(block_hashes(PROMPT, BS, eng.prefix_hash_salt)) & held


@pytest.mark.parametrize("salt", ["", "x" * 257, 7])
def test_a_bad_salt_is_a_400(make_engine, salt):
    eng = make_engine(block_size=BS)
    with pytest.raises(RequestError) as e:
        eng.make_sequence(GenerateRequest(request_id="bad", prompt_token_ids=PROMPT, cache_salt=salt))
    assert (e.value.status, e.value.param) == (400, "cache_salt")
