"""Attention over the paged KV pool.

Decode tokens attend with `paged_decode_attention`, written as gathers, products and reductions
that torch.compile (inductor) fuses into one loop reading each K/V block where it lies in the
pool: no padded per-layer copy, no mask tensor. Prompt chunks attend with SDPA (flash kernels),
causally over their own K/V, plus the cached context when the chunk continues a sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_decode_attention(
    q: torch.Tensor, pool_layer: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, scale: float,
    k_self: torch.Tensor | None = None, v_self: torch.Tensor | None = None, window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query token per sequence over its cached keys, read from the pool by block table.

    q [B, heads, d]; pool_layer [blocks, kv_heads, 2, block_size, d] (one layer of the pool);
    tables [B, max_blocks] (padding any valid block id); lens [B]: cached positions to attend.
    With k_self/v_self [B, kv_heads, d] the token (at position lens[b]) also attends to its own new
    K/V, which is not in the pool yet. A sliding `window` keeps the cached positions within it of
    the token; `softcap` caps the scores (tanh) before the mask, as transformers does. Softmax in
    float32; returns [B, heads, d] in q's dtype."""
    B, max_blocks = tables.shape
    nkv, bs, d = pool_layer.shape[1], pool_layer.shape[3], pool_layer.shape[4]
    g = q.shape[1] // nkv
    kv = pool_layer[tables]  # [B, max_blocks, nkv, 2, bs, d]; fused into the loops below when compiled
    k = kv[:, :, :, 0].permute(0, 2, 1, 3, 4).reshape(B, nkv, max_blocks * bs, d)[:, :, None]  # [B, nkv, 1, L, d]
    v = kv[:, :, :, 1].permute(0, 2, 1, 3, 4).reshape(B, nkv, max_blocks * bs, d)[:, :, None]
    qf = q.float().view(B, nkv, g, 1, d)
    s = _capped((qf * k.float()).sum(-1) * scale, softcap)  # [B, nkv, g, L]
    pos = torch.arange(max_blocks * bs, device=q.device)
    unseen = pos[None, :] >= lens[:, None]
    if window is not None:
        unseen |= pos[None, :] <= lens[:, None] - window
    s = s.masked_fill(unseen[:, None, None, :], float("-inf"))
    if k_self is not None:
        s_self = (qf[..., 0, :] * k_self.float()[:, :, None, :]).sum(-1, keepdim=True) * scale  # [B, nkv, g, 1]
        s = torch.cat([s, _capped(s_self, softcap)], dim=-1)
    p = torch.softmax(s, dim=-1)
    o = (p[..., : max_blocks * bs, None] * v.float()).sum(-2)  # [B, nkv, g, d]
    if v_self is not None:
        o = o + p[..., -1:] * v_self.float()[:, :, None, :]
    return o.reshape(B, nkv * g, d).to(q.dtype)


def _capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def gather_context(pool_layer: torch.Tensor, block_table: torch.Tensor, num_tokens: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [num_tokens, kv_heads, d] of one sequence, copied out of its blocks."""
    kv = pool_layer[block_table]  # [nb, nkv, 2, bs, d]
    nkv, d = kv.shape[1], kv.shape[-1]
    k = kv[:, :, 0].transpose(1, 2).reshape(-1, nkv, d)[:num_tokens]
    return k, kv[:, :, 1].transpose(1, 2).reshape(-1, nkv, d)[:num_tokens]


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """A prompt chunk's queries q [n, heads, d] at positions start..start+n-1 over keys k, v
    [start+n, kv_heads, d] (the cached context, then the chunk itself), causally."""
    q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    if not start:
        o = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale, enable_gqa=gqa)
    elif q.device.type == "cpu":
        o = _context_then_causal(q4, k4, v4, start, scale)
    else:
        total = k.shape[0]
        mask = torch.arange(total, device=q.device)[None, :] <= torch.arange(start, total, device=q.device)[:, None]
        o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o[0].transpose(0, 1)


def _context_then_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """A continuing chunk on the CPU as two flash passes merged by their log-sum-exp: every query over
    the context (no mask) and over the chunk (causal). SDPA with a boolean mask computes and masks
    every block instead (2k tokens over 2k of context, bf16, one thread: 285 ms a layer, this 183;
    BENCHMARKS.md, "Prefill throughput"). The CPU flash kernel takes grouped K/V heads as they are."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    o_ctx, lse_ctx = flash(q, k[:, :, :start], v[:, :, :start], scale=scale)
    o_new, lse_new = flash(q, k[:, :, start:], v[:, :, start:], is_causal=True, scale=scale)
    w_ctx = torch.sigmoid(lse_ctx - lse_new)[..., None]  # exp(lse_ctx) / (exp(lse_ctx) + exp(lse_new))
    return (o_new.float() + w_ctx * (o_ctx.float() - o_new.float())).to(q.dtype)


def sdpa_decode_attention(q: torch.Tensor, pool_layer: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """paged_decode_attention's eager stand-in (no compiler): gathers a padded copy of each
    sequence's blocks and runs SDPA with a length mask, which is faster than the unfused loops."""
    B, max_blocks = tables.shape
    nkv, d = pool_layer.shape[1], pool_layer.shape[4]
    kv = pool_layer[tables]  # [B, max_blocks, nkv, 2, bs, d]
    k = kv[:, :, :, 0].transpose(1, 2).reshape(B, nkv, -1, d)
    v = kv[:, :, :, 1].transpose(1, 2).reshape(B, nkv, -1, d)
    mask = (torch.arange(k.shape[2], device=q.device)[None, :] < lens[:, None])[:, None, None, :]
    o = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=mask, scale=scale,
                                       enable_gqa=q.shape[1] != nkv)
    return o[:, :, 0, :]
