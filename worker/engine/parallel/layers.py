"""The tensor-parallel building block a split model needs beyond its own linears: a rank holds a
slice of a weight and the row-parallel linear sums the ranks' partial products (column-parallel
needs no collective: a rank's output rows are its own). With a group of one it is the plain
operation. torch.compile traces it (group.py's collectives are functional ops).
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
