"""The math of one Llama-style decoder layer over a flat batch of tokens [T, hidden], split at the
attention so each forward path (the compiled decode step, the general eager step) brings its own.

It reproduces transformers' modules op for op (RMSNorm in float32 then cast, rotary on q and k,
act(gate) * up), so float32 outputs match `generate` token for token.
"""

from __future__ import annotations

import torch
from tandem.worker.engine.weights import Layer, ModelWeights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d] rotated by the cos/sin rows [T, d] of its tokens' positions."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def qkv(w: ModelWeights, layer: Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normalised input through the fused QKV matmul: q [T, heads, d], k and v [T, kv_heads, d]."""
    s = w.shape
    T = h.shape[0]
    x = layer.qkv(rms_norm(h, layer.ln1, s.eps))
    nq, nk = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    q = x[:, :nq].view(T, s.num_heads, s.head_dim)
    k = x[:, nq : nq + nk].view(T, s.num_kv_heads, s.head_dim)
    v = x[:, nq + nk :].reshape(T, s.num_kv_heads, s.head_dim)
    return rope(q, cos, sin), rope(k, cos, sin), v


def finish(w: ModelWeights, layer: Layer, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """Output projection and residual, then the MLP (fused gate/up) and residual."""
    h = h + layer.o(attn.reshape(h.shape[0], -1))
    gu = layer.gate_up(rms_norm(h, layer.ln2, w.shape.eps))
    gate, up = gu.split(w.shape.intermediate, dim=-1)
    return h + layer.down(layer.act(gate) * up)


def logits(w: ModelWeights, h: torch.Tensor) -> torch.Tensor:
    return w.lm_head(rms_norm(h, w.norm, w.shape.eps)).float()
