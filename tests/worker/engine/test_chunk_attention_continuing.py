"""A prompt chunk that continues a sequence (its context already cached) attends to the context and
causally to itself: the CPU path splits it into two flash passes merged by log-sum-exp, and must
equal attention written out in float64 (grouped K/V heads, fp32 and bf16, chunks longer and
shorter than their context)."""

import pytest
import torch
from tandem.worker.engine.attention import chunk_attention


def reference(q, k, v, start, scale):
    n, heads, _ = q.shape
    k = k.double().repeat_interleave(heads // k.shape[1], dim=1)
    v = v.double().repeat_interleave(heads // v.shape[1], dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    seen = torch.arange(k.shape[0])[None, :] <= torch.arange(start, start + n)[:, None]
    p = torch.softmax(s.masked_fill(~seen, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", p, v)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("n,start", [(64, 200), (300, 17), (1, 50), (128, 128)])
@pytest.mark.parametrize("heads,kv_heads", [(8, 4), (4, 4)])
def test_continuing_chunk_equals_written_out_attention(dtype, tol, n, start, heads, kv_heads):
    g = torch.Generator().manual_seed(n * 1000 + start)
    q = torch.randn(n, heads, 32, generator=g).to(dtype)
    k = torch.randn(start + n, kv_heads, 32, generator=g).to(dtype)
    v = torch.randn(start + n, kv_heads, 32, generator=g).to(dtype)
    out = chunk_attention(q, k, v, start, 32 ** -0.5)
    assert out.shape == q.shape and out.dtype == dtype
    assert (out.double() - reference(q, k, v, start, 32 ** -0.5)).abs().max().item() < tol


def test_first_chunk_is_causal_over_itself():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(40, 4, 16, generator=g) for _ in range(3))
    out = chunk_attention(q, k, v, 0, 0.25)
    assert (out.double() - reference(q, k, v, 0, 0.25)).abs().max().item() < 2e-6
    # the first query sees only the first key: its output is that key's value
    assert torch.allclose(out[0], v[0], atol=1e-6)
