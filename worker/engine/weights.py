"""The model's weights laid out for the engine's own forward pass: Q/K/V and gate/up concatenated
into one matrix each (one matmul instead of three or two), and on a CPU every matrix also
reordered once into oneDNN's blocked layout, which multiplies a batch 1.3-1.7x faster than a
plain row-major weight here. Built once per loaded model and shared by its engines.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("tandem.worker.engine")


def _use_mkldnn(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and torch.backends.mkldnn.is_available() and weight.dtype in (
        torch.float32, torch.bfloat16)


class PackedLinear(nn.Module):
    """y = x W^T (+ b), with W kept plain and, on a CPU, also reordered for oneDNN.

    A module with buffers (not a closure) so that a frozen torch.compile graph sees both as
    constants: batches of several tokens call oneDNN on the packed weight; a single token (batch
    1, where a matmul kernel streams weights at half the DRAM rate) becomes a dot product per row
    that inductor generates and fuses, at 22-25 GB/s here (bench/engine_decode.py)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None) if _use_mkldnn(weight) else None
        self.register_buffer("packed", packed, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1 and torch.compiler.is_compiling():
            # Products and sums in float32 without a float32 copy of the weight (freezing would fold one)
            y = torch.sum(x[:, None, :] * self.weight[None], dim=-1, dtype=torch.float32).to(x.dtype)
            return y if self.bias is None else y + self.bias
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def fuse(linears: list[Any]) -> torch.Tensor:
    """The modules' weights concatenated along the output dimension; each module's weight then
    becomes a view into the result, so the model keeps working and holds one copy."""
    fused = torch.cat([m.weight.detach() for m in linears])
    row = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(fused[row : row + n], requires_grad=False)
        row += n
    return fused


class Layer(nn.Module):
    def __init__(self, hf_layer: Any):
        super().__init__()
        a, m = hf_layer.self_attn, hf_layer.mlp
        bias = None
        if a.q_proj.bias is not None:
            bias = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]).detach()
        self.qkv = PackedLinear(fuse([a.q_proj, a.k_proj, a.v_proj]), bias)
        self.o = PackedLinear(a.o_proj.weight.detach())
        self.gate_up = PackedLinear(fuse([m.gate_proj, m.up_proj]))
        self.down = PackedLinear(m.down_proj.weight.detach())
        self.act = m.act_fn  # transformers' activation module for config.hidden_act (SiLU for Llama)
        self.register_buffer("ln1", hf_layer.input_layernorm.weight.detach(), persistent=False)
        self.register_buffer("ln2", hf_layer.post_attention_layernorm.weight.detach(), persistent=False)


@dataclass(frozen=True)
class Shape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    eps: float
    scaling: float


class ModelWeights(nn.Module):
    """Everything one step reads: fused and packed matrices, norms, embedding, rotary tables."""

    def __init__(self, hf_model: Any, max_positions: int):
        super().__init__()
        inner = hf_model.model
        cfg = hf_model.config
        attn0 = inner.layers[0].self_attn
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.shape = Shape(
            num_layers=cfg.num_hidden_layers, num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads, head_dim=head_dim, hidden=cfg.hidden_size,
            intermediate=cfg.intermediate_size, vocab=cfg.vocab_size,
            eps=float(inner.norm.variance_epsilon), scaling=float(attn0.scaling))
        self.layers = nn.ModuleList(Layer(layer) for layer in inner.layers)
        self.register_buffer("embed", inner.embed_tokens.weight.detach(), persistent=False)
        self.register_buffer("norm", inner.norm.weight.detach(), persistent=False)
        self.lm_head = PackedLinear(hf_model.lm_head.weight.detach())
        cos, sin = rotary_tables(inner.rotary_emb, max_positions, self.embed)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.dtype = self.embed.dtype


@torch.inference_mode()
def rotary_tables(rotary: Any, max_positions: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for every position, from the model's own rotary module: each position's row is
    computed independently there, so a table lookup equals what transformers computes per step."""
    pos = torch.arange(max_positions, device=like.device)[None]
    cos, sin = rotary(like[:1][None], pos)
    return cos[0].contiguous(), sin[0].contiguous()


def model_weights(loaded: Any, max_positions: int) -> ModelWeights:
    """The engine weights of a loaded model, built on first use and kept on it (engines share them)."""
    w = getattr(loaded, "engine_weights", None)
    if w is None or w.cos.shape[0] < max_positions:
        w = ModelWeights(loaded.model, max_positions)
        loaded.engine_weights = w
        log.info("engine weights: fused QKV and gate/up, %s linear kernels",
                 "oneDNN prepacked" if w.lm_head.packed is not None else "plain")
    return w
