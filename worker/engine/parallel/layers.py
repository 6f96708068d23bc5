"""The tensor-parallel building blocks, generic over the model: a rank holds a slice of a weight and
these modules add the one collective each slice needs. Column-parallel needs none (a rank's output
rows are its own: a plain linear over its rows, e.g. weights.PackedLinear); row-parallel sums the
ranks' partial products; the vocabulary-parallel embedding sums the ranks' lookups (each holds
some rows); the vocabulary-parallel head gathers the ranks' logits. With a group of one, each is
the plain operation. torch.compile traces them (group.py's collectives are functional ops).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_rank W_rank^T, (+ b once): `linear` multiplies by this rank's columns
    of W (the input features its column-parallel predecessor produced)."""

    def __init__(self, linear: nn.Module, group: Any, bias: torch.Tensor | None = None):
        super().__init__()
        self.linear = linear
        self.group = group
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(self.linear(x))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding rows start..start+len(weight) on this rank; a token held elsewhere contributes
    zeros here, and the sum over ranks is its row (exact: one term is non-zero)."""

    def __init__(self, weight: torch.Tensor, start: int, group: Any):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.start = start
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return self.weight[ids]
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        rows = self.weight[local.clamp(0, self.weight.shape[0] - 1)]
        return self.group.all_reduce(torch.where(inside.unsqueeze(-1), rows, torch.zeros_like(rows)))


class ParallelLMHead(nn.Module):
    """Logits over the whole vocabulary: `linear` holds this rank's rows of the output head, every
    rank the same number (the last padded with zero rows), gathered in rank order and trimmed."""

    def __init__(self, linear: nn.Module, vocab: int, group: Any):
        super().__init__()
        self.linear = linear
        self.vocab = vocab
        self.group = group

    @property
    def packed(self) -> bool:
        return bool(getattr(self.linear, "packed", False))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.linear(h)
        if self.group.size == 1:
            return logits
        return self.group.all_gather(logits, dim=-1)[..., : self.vocab]


def pad_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """`weight` with zero rows appended up to `rows` (a vocabulary slice made as long as the others)."""
    if weight.shape[0] >= rows:
        return weight
    return torch.cat([weight, weight.new_zeros(rows - weight.shape[0], *weight.shape[1:])])
