"""Log probabilities of the chosen token and the k likeliest alternatives, for the rows that ask.

Computed once per step for those rows together (one logsumexp, one gather, one top-k with the
largest k, one transfer to Python lists), from the model's raw logits: what `torch.log_softmax`
of the model's output gives, before temperature, penalties or a grammar change the draw (vLLM's
default, `raw_logprobs`). The wire shape (tandem.contracts.sampling.TokenLogprobs) carries ids;
the worker's HTTP layer adds each token's text (token_texts.py).
"""

from __future__ import annotations

import torch
from tandem.contracts.sampling import TokenLogprobs


def compute_logprobs(logits: torch.Tensor, chosen: list[int], ks: list[int | None]
                     ) -> list[TokenLogprobs | None]:
    """For each row with k not None: its chosen token's logprob and its top k as (id, logprob)."""
    idx = [i for i, k in enumerate(ks) if k is not None]
    out: list[TokenLogprobs | None] = [None] * len(ks)
    if not idx:
        return out
    dev = logits.device
    # log_softmax(x) = x - logsumexp(x): one reduction, and only the entries asked for are shifted
    x = logits[idx].float()
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    picked = (x.gather(1, torch.tensor([chosen[i] for i in idx], device=dev).unsqueeze(1)) - lse).squeeze(1).tolist()
    kmax = max(int(ks[i] or 0) for i in idx)
    top_v: list[list[float]] = [[] for _ in idx]
    top_i: list[list[int]] = [[] for _ in idx]
    if kmax:
        top = torch.topk(x, kmax, dim=-1)
        top_v, top_i = (top.values - lse).tolist(), top.indices.tolist()
    for j, i in enumerate(idx):
        k = int(ks[i] or 0)
        out[i] = TokenLogprobs(chosen[i], picked[j], list(zip(top_i[j][:k], top_v[j][:k], strict=True)))
    return out
