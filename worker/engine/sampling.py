"""Turning the last position's logits into the next token, per request.

Each draw uses a generator seeded from (request seed, output index), so a seeded request samples
the same tokens whether its first token came from a prefill worker, after a preemption, or not.
"""

from __future__ import annotations

import torch
from tandem.contracts.protocol import SamplingParams

_MASK64 = (1 << 63) - 1


def step_seed(seed: int, index: int) -> int:
    return (seed * 1_000_003 + index * 7_919 + 1) & _MASK64


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) what top-k and top-p exclude, for one row of logits."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked above it already reach top_p (the first always stays)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(
    logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], indices: list[int],
    argmax: torch.Tensor | None = None,
) -> list[int]:
    """The next token for each row: the argmax (computed for the whole batch at once, or given:
    the compiled decode step computes it) for greedy rows, a seeded draw for the others."""
    chosen = torch.argmax(logits, dim=-1) if argmax is None else argmax.clone()
    for i, p in enumerate(params):
        if p.temperature <= 0.0:
            continue
        row = filter_logits(logits[i].float() / p.temperature, p.top_k, p.top_p)
        gen = torch.Generator(device=logits.device).manual_seed(step_seed(seeds[i], indices[i]))
        chosen[i] = torch.multinomial(torch.softmax(row, dim=-1), 1, generator=gen)[0]
    return chosen.tolist()
