"""Turning the sampled rows' logits into next tokens, for the whole batch at once.

The logits processors (logits_processors.py: penalties, logit_bias, min_tokens, grammar masks) run
batched on the rows that use them; greedy rows take the argmax, the others a draw filtered by
temperature, top-k, top-p and min-p (batched) from a generator seeded from (request seed, output
index), so a seeded request samples the same tokens whether its first token came from a prefill
worker, after a preemption, or not. Log probabilities (logprobs.py) are of the model's raw
distribution, computed once for the rows that ask. A row with `forced_token_ids` (teacher forcing,
for the router's handoff parity probe) takes the given token instead of its draw and scores it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from tandem.contracts.sampling import SamplingParams
from tandem.worker.engine.logits_processors import apply_processors, needs_processing
from tandem.worker.engine.logprobs import TokenLogprobs, compute_logprobs

_MASK64 = (1 << 63) - 1


def step_seed(seed: int, index: int) -> int:
    return (seed * 1_000_003 + index * 7_919 + 1) & _MASK64


@dataclass
class SampleRow:
    """One sampled row of a step: its parameters and what the processors read of its sequence."""

    params: SamplingParams
    seed: int
    index: int  # output index of the token drawn now
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    eos_ids: frozenset[int] = frozenset()
    grammar: Any = None  # grammar.Grammar, or None

    @property
    def plain(self) -> bool:
        """Nothing but temperature, top-k and top-p: the runner's argmax serves a greedy row."""
        return not needs_processing(self) and self.params.logprobs is None


def filter_batch(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
                 ) -> torch.Tensor:
    """Mask (to -inf) what top-k, top-p and min-p exclude, each row with its own settings."""
    vocab = logits.shape[-1]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    if bool((k < vocab).any()):
        kth = torch.sort(logits, dim=-1, descending=True).values.gather(1, (k - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if bool((top_p < 1.0).any()):
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked above it already reach top_p (the first always stays)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p.unsqueeze(1)
        drop[:, 0] = False  # even when top_p rounds to 0 in float32 (1e-300)
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    if bool((min_p > 0).any()):
        probs = torch.softmax(logits, dim=-1)
        floor = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """filter_batch for one row of logits."""
    return filter_batch(logits[None], torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]))[0]


def _draw(logits: torch.Tensor, rows: list[SampleRow], chosen: torch.Tensor) -> None:
    """The seeded draws of the non-greedy rows, filtered together; one generator per row."""
    idx = [i for i, r in enumerate(rows) if not r.params.temperature <= 0.0]  # NaN draws (and fails its row)
    if not idx:
        return
    ps = [rows[i].params for i in idx]
    temps = torch.tensor([p.temperature for p in ps], device=logits.device).unsqueeze(1)
    x = filter_batch(logits[idx].float() / temps, torch.tensor([p.top_k for p in ps], device=logits.device),
                     torch.tensor([p.top_p for p in ps], device=logits.device),
                     torch.tensor([p.min_p for p in ps], device=logits.device))
    probs = torch.softmax(x, dim=-1)
    for j, i in enumerate(idx):
        gen = torch.Generator(device=logits.device).manual_seed(step_seed(rows[i].seed, rows[i].index))
        chosen[i] = torch.multinomial(probs[j], 1, generator=gen)[0]


def sample_batch(logits: torch.Tensor, rows: list[SampleRow], argmax: torch.Tensor | None = None
                 ) -> tuple[list[int], list[TokenLogprobs | None]]:
    """The next token of each row, and its log probabilities where the row asks for them."""
    raw = logits
    if any(needs_processing(r) for r in rows):
        logits = apply_processors(logits.float().clone(), rows)
        argmax = None  # the runner's argmax is of the unprocessed logits
    chosen = torch.argmax(logits, dim=-1) if argmax is None else argmax.clone()
    _draw(logits, rows, chosen)
    tokens = chosen.tolist()
    for i, r in enumerate(rows):  # teacher forcing: the given token, scored below like a drawn one
        if r.index < len(r.params.forced_token_ids):
            tokens[i] = r.params.forced_token_ids[r.index]
    return tokens, compute_logprobs(raw, tokens, [r.params.logprobs for r in rows])


def sample(
    logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], indices: list[int],
    argmax: torch.Tensor | None = None,
) -> list[int]:
    """sample_batch for rows that carry no sequence state (no history, no grammar)."""
    rows = [SampleRow(p, s, i) for p, s, i in zip(params, seeds, indices, strict=True)]
    return sample_batch(logits, rows, argmax)[0]
