"""The model's weights laid out for the engine's own forward pass: Q/K/V and gate/up concatenated
into one matrix each (one matmul instead of three or two), and on a CPU every matrix also
reordered once into oneDNN's blocked layout, which multiplies a batch 1.3-1.7x faster than a
plain row-major weight here. Built once per loaded model and shared by its engines.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("tandem.worker.engine")


def _use_mkldnn(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and torch.backends.mkldnn.is_available() and weight.dtype in (
        torch.float32, torch.bfloat16)


# A plain weight's address -> its oneDNN-prepacked copy. The compiled graph then holds only the
# plain weights (ordinary tensors its on-disk cache can store; the packed ones cannot be pickled).
_PACKED: dict[int, torch.Tensor] = {}


@torch.library.custom_op("tandem::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ b) by oneDNN on W's prepacked copy."""
    return torch.ops.mkldnn._linear_pointwise(x, _PACKED[weight.data_ptr()], bias, "none", [], "")


@packed_linear.register_fake
def _packed_linear_shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


def _forget(key: int, packed: torch.Tensor) -> None:
    if _PACKED.get(key) is packed:
        del _PACKED[key]


class PackedLinear(nn.Module):
    """y = x W^T (+ b), with W kept plain and, on a CPU, also reordered once for oneDNN.

    Batches of several tokens multiply with oneDNN on the packed copy (packed_linear). A single
    token inside the compiled graph becomes a dot product per row that inductor generates and
    fuses: matmul kernels stream a weight at about half the DRAM rate at batch 1, this at 22-25
    GB/s (python -m bench engine_decode)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.contiguous(), persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.packed = _use_mkldnn(weight)
        if self.packed:
            key, packed = self.weight.data_ptr(), torch.ops.mkldnn._reorder_linear_weight(self.weight, None)
            _PACKED[key] = packed
            weakref.finalize(self, _forget, key, packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1 and torch.compiler.is_compiling():
            # Products and sums in float32, reading the weight in its own dtype
            y = torch.sum(x[:, None, :] * self.weight[None], dim=-1, dtype=torch.float32).to(x.dtype)
            return y if self.bias is None else y + self.bias
        if self.packed:
            return packed_linear(x, self.weight, self.bias)
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


def model_weights(loaded: Any) -> ModelWeights:
    """The engine weights of a loaded model, built on first use and kept on it (engines share them)."""
    w = getattr(loaded, "engine_weights", None)
    if w is None:
        w = ModelWeights(loaded.model, loaded.max_model_len)
        loaded.engine_weights = w
        log.info("engine weights: fused QKV and gate/up, %s linear kernels",
                 "oneDNN prepacked" if w.lm_head.packed else "plain")
    return w
