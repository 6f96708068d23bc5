"""One rank's ModelWeights for a Llama-family checkpoint (llama, mistral, qwen2): its shard of every
matrix (sharding.py), read by name (checkpoint.py), with the collectives each needs (layers.py).
With one rank and a loaded transformers module this is the whole model, read as views of the
module's own tensors, exactly as before tensor parallelism.
"""

from __future__ import annotations

from typing import Any

import torch
from tandem.worker.engine.parallel.checkpoint import (
    CheckpointReader,
    ModuleReader,
    local_checkpoint,
)
from tandem.worker.engine.parallel.group import ParallelGroup
from tandem.worker.engine.parallel.layers import (
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    pad_rows,
)
from tandem.worker.engine.parallel.sharding import Shard
from tandem.worker.engine.weights import Layer, ModelWeights, PackedLinear, Shape, rotary_tables


def shard_of(config: Any, group: ParallelGroup) -> Shard:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return Shard(rank=group.rank, size=group.size, num_heads=config.num_attention_heads,
                 num_kv_heads=config.num_key_value_heads, head_dim=head_dim,
                 intermediate=config.intermediate_size, vocab=config.vocab_size)


def skeleton(config: Any) -> Any:
    """The transformers module without weights (on the meta device): its rotary, activation,
    norm epsilon and attention scale are what the forward pass must reproduce."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _layer(reader: Any, i: int, shard: Shard, group: ParallelGroup, act: Any) -> Layer:
    p = f"model.layers.{i}."
    a, m = p + "self_attn.", p + "mlp."
    q, kv, mlp = shard.q_rows(), shard.kv_rows(), shard.mlp_rows()
    names = [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]
    bias = None
    if reader.has(a + "q_proj.bias"):
        bias = torch.cat([reader.rows(a + f"{x}_proj.bias", s) for x, s in (("q", q), ("k", kv), ("v", kv))])
    qkv = PackedLinear(reader.fused_rows(names, [q, kv, kv]), bias)
    o = RowParallelLinear(PackedLinear(reader.cols(a + "o_proj.weight", q)), group)
    gate_up = PackedLinear(reader.fused_rows([m + "gate_proj.weight", m + "up_proj.weight"], [mlp, mlp]))
    down = RowParallelLinear(PackedLinear(reader.cols(m + "down_proj.weight", mlp)), group)
    return Layer(qkv, o, gate_up, down, act, reader.full(p + "input_layernorm.weight"),
                 reader.full(p + "post_attention_layernorm.weight"))


@torch.inference_mode()
def build_weights(loaded: Any) -> ModelWeights:
    """The rank's weights: `loaded.group` (None: one rank) and either `loaded.model` (a transformers
    module, one rank) or the checkpoint folder named by `loaded.weights_path`."""
    group = getattr(loaded, "group", None) or ParallelGroup.single(loaded.device)
    cfg = loaded.config
    shard = shard_of(cfg, group)
    if loaded.model is not None:
        if group.size > 1:
            raise ValueError("a tensor-parallel rank reads its slices from the checkpoint, not a loaded model")
        reader, skel = ModuleReader(loaded.model), loaded.model
    else:
        folder = getattr(loaded, "weights_path", None) or local_checkpoint(cfg.name_or_path)
        reader, skel = CheckpointReader(folder, loaded.dtype, loaded.device), skeleton(cfg)
    inner = skel.model
    attn0 = inner.layers[0].self_attn
    act = inner.layers[0].mlp.act_fn
    layers = [_layer(reader, i, shard, group, act) for i in range(cfg.num_hidden_layers)]
    rows = shard.vocab_rows()
    embed_rows = reader.rows("model.embed_tokens.weight", rows)
    head_name = "lm_head.weight" if reader.has("lm_head.weight") else "model.embed_tokens.weight"  # tied
    head_rows = embed_rows if head_name == "model.embed_tokens.weight" else reader.rows(head_name, rows)
    if group.size > 1:
        head_rows = pad_rows(head_rows, shard.vocab_chunk)
    lm_head = ParallelLMHead(PackedLinear(head_rows), cfg.vocab_size, group)
    rotary = type(inner.rotary_emb)(config=cfg) if loaded.model is None else inner.rotary_emb
    rotary = rotary.to(loaded.device)
    shape = Shape(num_layers=cfg.num_hidden_layers, num_heads=shard.q_heads.size,
                  num_kv_heads=shard.kv_heads.size, head_dim=shard.head_dim, hidden=cfg.hidden_size,
                  intermediate=shard.mlp_rows().size, vocab=cfg.vocab_size,
                  eps=float(inner.norm.variance_epsilon), scaling=float(attn0.scaling))
    return ModelWeights(shape, layers, VocabParallelEmbedding(embed_rows, rows.start, group),
                        reader.full("model.norm.weight"), lm_head,
                        rotary_tables(rotary, loaded.max_model_len, embed_rows), group)

