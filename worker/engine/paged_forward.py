"""The forward pass over the paged KV pool: a flat batch of tokens from many sequences (prefill
chunks and decode tokens mixed) through the loaded model's own modules.

New K/V are written into the pool at each token's slot; attention then reads each sequence's
blocks. Decode tokens are attended in one padded batch; prefill chunks one sequence at a time
(a prompt that starts at position 0 attends to its own fresh K/V without a gather).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tandem.contracts.kv_layout import KVLayout
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb


@dataclass
class BatchItem:
    token_ids: list[int]
    start: int  # position of token_ids[0] in the sequence
    block_table: list[int]
    sample: bool  # return logits for the last token


def kv_layout_for(config, num_blocks: int, block_size: int, dtype: torch.dtype) -> KVLayout:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return KVLayout(
        num_blocks=num_blocks,
        num_layers=config.num_hidden_layers,
        block_size=block_size,
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        dtype=str(dtype).removeprefix("torch."),
    )


class PagedForward:
    def __init__(self, model, pool: torch.Tensor, layout: KVLayout):
        self.model = model
        inner = model.model
        self.embed = inner.embed_tokens
        self.layers = inner.layers
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head = model.lm_head
        self.pool = pool
        self.layout = layout
        self.block_size = layout.block_size
        cfg = model.config
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = layout.head_dim
        self.scaling = self.layers[0].self_attn.scaling
        self.device = pool.device

    @torch.inference_mode()
    def forward(self, items: list[BatchItem]) -> torch.Tensor:
        """Logits (float32) for the last token of every item with sample=True, in order."""
        dev, bs = self.device, self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        sample_idx: list[int] = []
        decode: list[int] = []  # item indexes of single-token items
        prefill: list[int] = []
        offsets: list[int] = []
        for i, it in enumerate(items):
            offsets.append(len(ids))
            n = len(it.token_ids)
            ids.extend(it.token_ids)
            for p in range(it.start, it.start + n):
                pos.append(p)
                slot_blocks.append(it.block_table[p // bs])
                slot_offsets.append(p % bs)
            if it.sample:
                sample_idx.append(len(ids) - 1)
            (decode if n == 1 else prefill).append(i)
        T = len(ids)
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        sb = torch.tensor(slot_blocks, dtype=torch.long, device=dev)
        so = torch.tensor(slot_offsets, dtype=torch.long, device=dev)

        if decode:
            lens = [items[i].start + 1 for i in decode]
            max_blocks = max(-(-n // bs) for n in lens)
            tables = torch.tensor(
                [items[i].block_table[:max_blocks] + [0] * (max_blocks - len(items[i].block_table[:max_blocks]))
                 for i in decode], dtype=torch.long, device=dev)
            dec_tok = torch.tensor([offsets[i] for i in decode], dtype=torch.long, device=dev)
            key_pos = torch.arange(max_blocks * bs, device=dev)
            dec_mask = (key_pos[None, :] < torch.tensor(lens, device=dev)[:, None])[:, None, None, :]

        # Per prefill chunk: where its queries sit, and (when it continues a sequence) the blocks
        # to gather and the causal mask offset by what is already cached.
        chunks = []
        for i in prefill:
            it, s, n = items[i], offsets[i], len(items[i].token_ids)
            if it.start == 0:
                chunks.append((s, n, 0, None, None))
                continue
            total = it.start + n
            table = torch.tensor(it.block_table[: -(-total // bs)], dtype=torch.long, device=dev)
            qpos = torch.arange(it.start, total, device=dev)
            mask = torch.arange(total, device=dev)[None, :] <= qpos[:, None]
            chunks.append((s, n, total, table, mask))

        h = self.embed(input_ids[None])  # [1, T, H]
        cos, sin = self.rotary(h, positions[None])
        cos, sin = cos[0], sin[0]  # [T, D]
        h = h[0]
        nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        for li, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(T, nh, d)
            k = attn.k_proj(x).view(T, nkv, d)
            v = attn.v_proj(x).view(T, nkv, d)
            q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
            self.pool[sb, li, 0, so] = k
            self.pool[sb, li, 1, so] = v
            out = torch.empty(T, nh, d, dtype=q.dtype, device=dev)
            if decode:
                kv = self.pool[tables, li]  # [B, nb, 2, bs, nkv, d]
                B = kv.shape[0]
                kd = kv[:, :, 0].reshape(B, -1, nkv, d).transpose(1, 2)
                vd = kv[:, :, 1].reshape(B, -1, nkv, d).transpose(1, 2)
                qd = q[dec_tok][:, :, None, :]  # [B, nh, 1, d]
                o = F.scaled_dot_product_attention(
                    qd, kd, vd, attn_mask=dec_mask, scale=self.scaling, enable_gqa=nh != nkv)
                out[dec_tok] = o[:, :, 0, :]
            for s, n, total, table, mask in chunks:
                qs = q[s : s + n].transpose(0, 1)[None]
                if table is None:  # the chunk is the whole sequence so far: its own K/V suffice
                    ks, vs = k[s : s + n], v[s : s + n]
                else:
                    kv = self.pool[table, li]
                    ks = kv[:, 0].reshape(-1, nkv, d)[:total]
                    vs = kv[:, 1].reshape(-1, nkv, d)[:total]
                o = F.scaled_dot_product_attention(
                    qs, ks.transpose(0, 1)[None], vs.transpose(0, 1)[None], attn_mask=mask,
                    is_causal=table is None, scale=self.scaling, enable_gqa=nh != nkv)
                out[s : s + n] = o[0].transpose(0, 1)
            h = h + attn.o_proj(out.view(T, nh * d))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        if not sample_idx:
            return torch.empty(0, self.lm_head.out_features, device=dev)
        last = self.norm(h[torch.tensor(sample_idx, device=dev)])
        return self.lm_head(last).float()
