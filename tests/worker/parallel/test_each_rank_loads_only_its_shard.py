"""Each rank's weights are its slices of the checkpoint, read by name, and together they are the
model: query heads and MLP rows split, KV heads split or replicated, o/down split by columns,
embedding and output head by vocabulary rows (the last rank's head padded)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tandem.worker.engine.loader import load_model
from tandem.worker.engine.parallel.group import GroupSpec, ParallelGroup
from tandem.worker.engine.parallel.sharded_weights import build_weights


@pytest.fixture(scope="module")
def toy(toy_model_dir):
    torch.set_num_threads(1)
    return load_model(str(toy_model_dir), dtype="float32", device="cpu")


def rank_weights(toy, size: int, rank: int):
    """Rank `rank` of `size`: built from the checkpoint alone (no model, no collective needed to build)."""
    lm = dataclasses.replace(toy, model=None, weights_path=str(toy.config.name_or_path),
                             group=ParallelGroup(GroupSpec(size, rank, "", 0), torch.device("cpu")))
    return build_weights(lm)


def test_one_rank_from_the_checkpoint_equals_the_loaded_model(toy):
    from_module = build_weights(toy)
    from_file = rank_weights(toy, 1, 0)
    a, b = dict(from_module.named_buffers()), dict(from_file.named_buffers())
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("size", [2, 4])
def test_shards_add_up_to_the_model(toy, size):
    hf = {k: v.detach() for k, v in toy.model.named_parameters()}
    cfg = toy.config
    d = cfg.hidden_size // cfg.num_attention_heads
    shards = [rank_weights(toy, size, r) for r in range(size)]
    q_per, kv_total = cfg.num_attention_heads // size, cfg.num_key_value_heads
    for li in range(cfg.num_hidden_layers):
        p = f"model.layers.{li}."
        qs, ks = [], []
        for r, w in enumerate(shards):
            qkv = w.layers[li].qkv.weight
            q, k, v = qkv.split([q_per * d, w.shape.num_kv_heads * d, w.shape.num_kv_heads * d])
            qs.append(q)
            ks.append(k)
            head = r * kv_total // size  # the KV head a rank holds (4 ranks, 2 heads: each twice)
            if size > kv_total:
                assert torch.equal(k, hf[p + "self_attn.k_proj.weight"][head * d:(head + 1) * d])
                assert torch.equal(v, hf[p + "self_attn.v_proj.weight"][head * d:(head + 1) * d])
        assert torch.equal(torch.cat(qs), hf[p + "self_attn.q_proj.weight"])
        if size <= kv_total:
            assert torch.equal(torch.cat(ks), hf[p + "self_attn.k_proj.weight"])
        o = torch.cat([w.layers[li].o.linear.weight for w in shards], dim=1)
        assert torch.equal(o, hf[p + "self_attn.o_proj.weight"])
        down = torch.cat([w.layers[li].down.linear.weight for w in shards], dim=1)
        assert torch.equal(down, hf[p + "mlp.down_proj.weight"])
        gate = torch.cat([w.layers[li].gate_up.weight[: w.shape.intermediate] for w in shards])
        assert torch.equal(gate, hf[p + "mlp.gate_proj.weight"])
    embed = torch.cat([w.embed.weight for w in shards])
    assert torch.equal(embed, hf["model.embed_tokens.weight"])
    head = torch.cat([w.lm_head.linear.weight for w in shards])[: cfg.vocab_size]
    assert torch.equal(head, hf["lm_head.weight"])
    assert all(w.lm_head.linear.weight.shape[0] == -(-cfg.vocab_size // size) for w in shards)


def test_a_rank_reads_a_fraction_of_the_checkpoint(toy):
    from tandem.worker.engine.parallel.checkpoint import CheckpointReader
    from tandem.worker.engine.parallel.sharded_weights import _layer, shard_of

    group = ParallelGroup(GroupSpec(2, 1, "", 0), torch.device("cpu"))
    reader = CheckpointReader(toy.config.name_or_path, torch.float32, torch.device("cpu"))
    _layer(reader, 0, shard_of(toy.config, group), group, torch.nn.SiLU())
    layer0 = sum(v.numel() * 4 for k, v in toy.model.named_parameters() if k.startswith("model.layers.0."))
    norms = 2 * toy.config.hidden_size * 4  # replicated on every rank
    assert reader.bytes_read == (layer0 - norms) // 2 + norms
