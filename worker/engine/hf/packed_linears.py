"""On a CPU, every `nn.Linear` of a transformers model swapped for the engine's oneDNN-prepacked
linear (weights.py): the same product with the weight reordered once into oneDNN's blocked layout,
which multiplies a batch 1.3-1.7x faster here than the row-major weight nn.Linear reads. The
model's structure, weights (shared, not copied) and code stay its own."""

from __future__ import annotations

from typing import Any

import torch
from tandem.worker.engine.weights import PackedLinear
from torch import nn


class FlatPackedLinear(PackedLinear):
    """PackedLinear for inputs with any leading dimensions ([1, tokens, in] in a transformers model)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        return super().forward(x.reshape(-1, x.shape[-1])).view(*lead, self.out_features)


def pack_linears(model: nn.Module) -> int:
    """Replace each nn.Linear on a CPU in `model` (in place) by a FlatPackedLinear over the same
    weight; returns how many are prepacked (oneDNN takes float32 and bfloat16)."""
    swaps: list[tuple[Any, str, nn.Linear]] = [
        (parent, name, child) for parent in model.modules() for name, child in parent.named_children()
        if type(child) is nn.Linear and child.weight.device.type == "cpu"]
    packed = 0
    for parent, name, lin in swaps:
        new = FlatPackedLinear(lin.weight.detach(), None if lin.bias is None else lin.bias.detach())
        setattr(parent, name, new)
        packed += new.packed
    return packed
