"""On a CPU, every `nn.Linear` of a transformers model swapped for the engine's oneDNN-prepacked
linear (`PackedLinear`): the same product with the weight reordered once into oneDNN's blocked
layout, which multiplies a batch 1.3-1.7x faster here than the row-major weight nn.Linear reads.
The model's structure, weights (shared, not copied) and code stay its own."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def _use_mkldnn(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and torch.backends.mkldnn.is_available() and weight.dtype in (
        torch.float32, torch.bfloat16)


# The oneDNN-prepacked copy of a weight hangs on the plain weight tensor itself (its owner: it
# lives and dies with it). The compiled graph then holds only the plain weights (ordinary tensors
# its on-disk cache can store; the packed ones cannot be pickled) and the op below finds the copy.
PACKED_ATTR = "tandem_onednn_packed"


@torch.library.custom_op("tandem::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ b) by oneDNN on W's prepacked copy."""
    return torch.ops.mkldnn._linear_pointwise(x, getattr(weight, PACKED_ATTR), bias, "none", [], "")


@packed_linear.register_fake
def _packed_linear_shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


class PackedLinear(nn.Module):
    """y = x W^T (+ b), with W kept plain and, on a CPU, also reordered once for oneDNN.

    Batches of several tokens multiply with oneDNN on the packed copy (packed_linear). A single
    token inside the compiled graph becomes a dot product per row that inductor generates and
    fuses: matmul kernels stream a weight at about half the DRAM rate at batch 1, this at 22-25
    GB/s (python -m bench engine_decode)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.contiguous(), persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.packed = _use_mkldnn(weight)
        if self.packed:
            setattr(self.weight, PACKED_ATTR, torch.ops.mkldnn._reorder_linear_weight(self.weight, None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1 and torch.compiler.is_compiling():
            # Products and sums in float32, reading the weight in its own dtype
            y = torch.sum(x[:, None, :] * self.weight[None], dim=-1, dtype=torch.float32).to(x.dtype)
            return y if self.bias is None else y + self.bias
        if self.packed:
            return packed_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


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
