"""Tandem's paged attention as a transformers attention function.

Registered in transformers' `AttentionInterface` under ATTENTION_NAME: a model loaded with that
`attn_implementation` calls `paged_attention` from each of its attention layers with the layer's
queries, keys and values (rotary and any q/k norm applied, as the model computes them) for the
step's flat batch of tokens. It writes the keys and values into the pool, then attends: decode
tokens by block table, prompt chunks over their context, each with the layer's own sliding window,
logit soft-capping and attention sinks. A layer with none of those attends with attention.py's
kernels (on a CPU a continuing chunk is two flash passes, context and chunk, merged).
transformers builds no mask for an implementation it does not know, so the step (PagedStep)
carries what the masks need. A decode-only step compiled as one graph comes as a LayerDecode
(decode_graph.py): it reads the pool and writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from tandem.worker.engine.attention import chunk_attention, gather_context, sdpa_decode_attention
from tandem.worker.engine.hf.decode_graph import STEP_KWARG, LayerDecode, decode_attention
from tandem.worker.engine.step_inputs import StepInputs

ATTENTION_NAME = "tandem_paged"


@dataclass
class PagedStep:
    """One forward pass's view of the pool: where each token's K/V goes and what it may attend."""

    pool: torch.Tensor  # [blocks, kv_heads, layers, 2, block_size, head_dim] (contracts/kv_layout.py)
    st: StepInputs
    windows: list[int | None]  # each layer's sliding window as the model's masks apply it (layer_windows)
    decode: torch.Tensor | None = None  # flat rows of the single-token items
    lens: torch.Tensor | None = None  # their context length, themselves included
    layers_seen: list[int] = field(default_factory=list)  # layer_idx of every call (the runner checks)
    sinks: bool = False  # a layer called has attention sinks (the compiled decode step has none)
    _masks: dict[tuple, torch.Tensor | None] = field(default_factory=dict)

    @classmethod
    def build(cls, pool: torch.Tensor, st: StepInputs, windows: list[int | None]) -> PagedStep:
        step = cls(pool, st, windows)
        if st.decode_rows:
            step.decode = torch.tensor(st.decode_rows, dtype=torch.long, device=pool.device)
            step.lens = st.positions[step.decode] + 1
        return step

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """[B, 1, 1, L]: the cached positions each decode token sees (its length, its window)."""
        key = ("decode", window)
        if key not in self._masks:
            assert self.st.tables is not None and self.lens is not None
            length = self.st.tables.shape[1] * self.pool.shape[4]
            kv = torch.arange(length, device=self.pool.device)[None, :]
            seen = kv < self.lens[:, None]
            if window is not None:
                seen &= kv >= self.lens[:, None] - window
            self._masks[key] = seen[:, None, None, :]
        return self._masks[key]

    def chunk_mask(self, i: int, window: int | None) -> torch.Tensor | None:
        """[1, 1, n, start+n] for chunk i (causal, within the window); None: plain causal from 0."""
        key = ("chunk", i, window)
        if key not in self._masks:
            c = self.st.chunks[i]
            if not c.start and window is None:
                self._masks[key] = None
            else:
                q = torch.arange(c.start, c.start + c.num_tokens, device=self.pool.device)[:, None]
                kv = torch.arange(c.start + c.num_tokens, device=self.pool.device)[None, :]
                seen = kv <= q
                if window is not None:
                    seen &= kv > q - window
                self._masks[key] = seen[None, None]
        return self._masks[key]


ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


def layer_windows(config: Any) -> list[int | None]:
    """Each layer's sliding window as transformers' masks apply it (the masks, not the keyword some
    layers pass, are what generate computes with): `layer_types` names the sliding layers where the
    config has them, else `sliding_window` applies to every layer. Raises ValueError for a layer
    kind the paged attention does not compute (chunked, linear, recurrent)."""
    cfg = config.get_text_config()
    window = getattr(cfg, "sliding_window", None)
    types = list(getattr(cfg, "layer_types", None) or [])[: cfg.num_hidden_layers]
    if not types:
        return [window] * cfg.num_hidden_layers
    if unknown := sorted(set(types) - set(ATTENTION_LAYER_TYPES)):
        raise ValueError(f"layers of type {', '.join(unknown)}: the paged attention computes only "
                         f"{' and '.join(ATTENTION_LAYER_TYPES)} layers")
    return [window if t == "sliding_attention" else None for t in types]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
           softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, n, d] over k, v [B, KV, L, d] (mask [B, 1, n, L] of what is seen; None: causal).
    SDPA where it computes the same thing; otherwise transformers' eager order: scale, soft-cap,
    mask, sinks joining the softmax (in float32), then the values."""
    groups = q.shape[1] // k.shape[1]
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=groups > 1)
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        n, length = scores.shape[-2:]
        mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1).to(scores.dtype)
        scores = torch.cat([scores, sink], dim=-1)
        scores = scores - scores.max(dim=-1, keepdim=True).values
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs, v)


def paged_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                    sliding_window: int | None = None, softcap: float | None = None,
                    s_aux: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [1, H, T, d], key/value [1, KV, T, d]
    for the step's T tokens; returns [1, T, H, d]."""
    step: PagedStep | None = kwargs.get(STEP_KWARG)
    if step is None:
        raise RuntimeError(f"{type(module).__name__} was called without Tandem's paged step: this model's "
                           "forward does not pass keyword arguments down to its attention layers")
    if attention_mask is not None:
        raise RuntimeError(f"{type(module).__name__} passes an attention mask of its own making; the paged "
                           "attention builds its masks from positions and windows and cannot honour another")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if isinstance(step, LayerDecode):  # the compiled decode step (decode_graph.py)
        return decode_attention(step, query, key, value, scale, softcap), None
    li = module.layer_idx
    step.layers_seen.append(li)
    window = step.windows[li]
    if sliding_window is not None and sliding_window != window:
        raise RuntimeError(f"layer {li} asks for a {sliding_window}-token window where the model's masks apply "
                           f"{window or 'none'}")
    st, pool_layer = step.st, step.pool[:, :, li]  # [blocks, KV, 2, bs, d]
    k = key[0].transpose(0, 1)  # [T, KV, d]
    v = value[0].transpose(0, 1)
    held = (pool_layer.shape[1], pool_layer.shape[4])
    if k.shape[1:] != held or v.shape[1:] != held:
        raise RuntimeError(f"layer {li} produced K {tuple(k.shape[1:])} / V {tuple(v.shape[1:])} per token, "
                           f"the KV pool holds {held} (kv_heads, head_dim)")
    pool_layer[st.slot_blocks, :, 0, st.slot_offsets] = k
    pool_layer[st.slot_blocks, :, 1, st.slot_offsets] = v
    # Heads first: gathering blocks from these views gives [KV, blocks..., bs, d] in one contiguous
    # copy, which reshapes to [KV, tokens, d] without another.
    keys, values = pool_layer[:, :, 0].transpose(0, 1), pool_layer[:, :, 1].transpose(0, 1)
    sinks = s_aux if s_aux is not None else getattr(module, "sinks", None)
    out = torch.empty_like(query)  # [1, H, T, d]
    plain = window is None and softcap is None and sinks is None  # attention.py's kernels compute it
    step.sinks = step.sinks or sinks is not None
    if step.decode is not None:
        assert st.tables is not None and step.lens is not None
        q = query[0, :, step.decode].transpose(0, 1)  # [B, H, d]
        if plain:
            o = sdpa_decode_attention(q, pool_layer, st.tables, step.lens, scale)
        else:
            B, heads, d = st.tables.shape[0], *held
            ks = keys[:, st.tables].view(heads, B, -1, d).transpose(0, 1)  # [B, KV, L, d]
            vs = values[:, st.tables].view(heads, B, -1, d).transpose(0, 1)
            o = attend(q[:, :, None], ks, vs, step.decode_mask(window), scale, softcap, sinks)[:, :, 0]
        out[0, :, step.decode] = o.transpose(0, 1)
    for i, c in enumerate(st.chunks):
        rows = slice(c.offset, c.offset + c.num_tokens)
        if plain:  # the CPU's continuing chunk: context and chunk as two flash passes (attention.py)
            q, (ks, vs) = query[0, :, rows].transpose(0, 1), _chunk_context(k, v, rows, pool_layer, c)
            out[0, :, rows] = chunk_attention(q, ks, vs, c.start, scale).transpose(0, 1)
            continue
        if c.table is None:  # the chunk is the whole sequence so far: its own K/V suffice
            ks, vs = key[:, :, rows], value[:, :, rows]
        else:
            n = c.start + c.num_tokens
            ks = keys[:, c.table].view(held[0], -1, held[1])[None, :, :n]  # [1, KV, n, d]
            vs = values[:, c.table].view(held[0], -1, held[1])[None, :, :n]
        out[:, :, rows] = attend(query[:, :, rows], ks, vs, step.chunk_mask(i, window), scale, softcap,
                                 sinks)
    return out.transpose(1, 2), None


def _chunk_context(k: torch.Tensor, v: torch.Tensor, rows: slice, pool_layer: torch.Tensor, c: Any
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's keys and values [start + n, KV, d]: its own (a whole sequence so far), or its
    context and itself out of the pool."""
    if c.table is None:
        return k[rows], v[rows]
    return gather_context(pool_layer, c.table, c.start + c.num_tokens)


def register() -> str:
    """Make ATTENTION_NAME a valid `attn_implementation` (idempotent); returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    return ATTENTION_NAME
