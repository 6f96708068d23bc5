"""The K/V the engine writes into its paged pool equal what transformers' own DynamicCache holds
for the same prompt (float32; tolerance atol=1e-5, rtol=1e-4: same math, different kernels)."""

from __future__ import annotations

import torch
from tandem.contracts.protocol import GenerateRequest
from tandem.contracts.sampling import SamplingParams

PROMPT = ("Once upon a time there was a little model that wanted to speak every language, "
          "and it read the whole prompt at once.")


def _pool_kv(eng, block_table: list[int], num_tokens: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = eng.pool[torch.tensor(block_table), :, layer]  # [nb, kv_heads, 2, bs, head_dim]
    k = blocks[:, :, 0].transpose(0, 1).flatten(1, 2)[:, :num_tokens]
    v = blocks[:, :, 1].transpose(0, 1).flatten(1, 2)[:, :num_tokens]
    return k, v  # [kv_heads, tokens, head_dim], as the cache holds them


def test_pool_holds_the_same_kv_as_transformers(make_engine, hf_toy, loaded_toy):
    # Chunked (8 tokens a step) in blocks of 4: the KV is assembled over several steps and blocks.
    eng = make_engine(block_size=4, max_batched_tokens=8, max_num_seqs=4)
    ids = loaded_toy.tokenizer(PROMPT)["input_ids"]
    assert len(ids) > 16
    seq = eng.make_sequence(
        GenerateRequest(request_id="kv", prompt_token_ids=ids, sampling=SamplingParams(max_tokens=4, temperature=0)),
        prefill_only=True)  # a prefill-only sequence keeps its blocks leased after the first token
    eng.add(seq)
    while eng.has_work():
        eng.step()
    assert "kv" in eng.leases
    table = eng.leases["kv"].seq.block_table
    assert len(table) == -(-len(ids) // 4)
    with torch.no_grad():
        cache = hf_toy(torch.tensor([ids]), use_cache=True).past_key_values
    for layer in range(hf_toy.config.num_hidden_layers):
        k, v = _pool_kv(eng, table, len(ids), layer)
        torch.testing.assert_close(k, cache.layers[layer].keys[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(v, cache.layers[layer].values[0], atol=1e-5, rtol=1e-4)
    assert eng.abort("kv", eng.lease_token("kv"))
