"""The model's weights laid out for the engine's own forward pass: Q/K/V and gate/up concatenated
into one matrix each (one matmul instead of three or two), and on a CPU every matrix also
reordered once into oneDNN's blocked layout, which multiplies a batch 1.3-1.7x faster than a
plain row-major weight here. Built once per loaded model and shared by its engines; under tensor
parallelism each rank builds its own shard (parallel/sharded_weights.py) with the same classes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("tandem.worker.engine")


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


class Layer(nn.Module):
    """One decoder layer's matrices (a rank's shard of them under tensor parallelism) and norms.
    `o` and `down` sum their output over the ranks (parallel/layers.py RowParallelLinear)."""

    def __init__(self, qkv: nn.Module, o: nn.Module, gate_up: nn.Module, down: nn.Module, act: nn.Module,
                 ln1: torch.Tensor, ln2: torch.Tensor):
        super().__init__()
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down
        self.act = act  # transformers' activation module for config.hidden_act (SiLU for Llama)
        self.register_buffer("ln1", ln1, persistent=False)
        self.register_buffer("ln2", ln2, persistent=False)


@dataclass(frozen=True)
class Shape:
    """The dimensions one rank computes with: its own query and KV heads and MLP share, the whole
    hidden size and vocabulary."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    eps: float
    scaling: float


class ModelWeights(nn.Module):
    """Everything one step reads: fused and packed matrices, norms, embedding, output head, rotary
    tables; `group` is the tensor-parallel group the shards belong to (one rank: no collectives)."""

    def __init__(self, shape: Shape, layers: list[Layer], embed: nn.Module, norm: torch.Tensor,
                 lm_head: nn.Module, rotary: tuple[torch.Tensor, torch.Tensor], group: Any):
        super().__init__()
        self.shape = shape
        self.layers = nn.ModuleList(layers)
        self.embed = embed  # ids [T] -> [T, hidden] (parallel/layers.py VocabParallelEmbedding)
        self.register_buffer("norm", norm, persistent=False)
        self.lm_head = lm_head  # [T, hidden] -> [T, vocab] (parallel/layers.py ParallelLMHead)
        self.register_buffer("cos", rotary[0], persistent=False)
        self.register_buffer("sin", rotary[1], persistent=False)
        self.dtype = norm.dtype
        self.group = group

    @property
    def packed(self) -> bool:
        return bool(self.layers) and getattr(self.layers[0].qkv, "packed", False)


@torch.inference_mode()
def rotary_tables(rotary: Any, max_positions: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for every position, from the model's own rotary module: each position's row is
    computed independently there, so a table lookup equals what transformers computes per step."""
    pos = torch.arange(max_positions, device=like.device)[None]
    cos, sin = rotary(like[:1][None], pos)
    return cos[0].contiguous(), sin[0].contiguous()


def model_weights(loaded: Any) -> ModelWeights:
    """The engine weights of a loaded model, built on first use and kept on it (engines share them):
    from the loaded transformers module on one rank, from the rank's slices of the checkpoint
    under tensor parallelism (loaded.group)."""
    w = getattr(loaded, "engine_weights", None)
    if w is None:
        from tandem.worker.engine.parallel.sharded_weights import build_weights

        w = build_weights(loaded)
        loaded.engine_weights = w
        log.info("engine weights: fused QKV and gate/up, %s linear kernels%s",
                 "oneDNN prepacked" if w.packed else "plain",
                 f", rank {w.group.rank} of {w.group.size}" if w.group.size > 1 else "")
    return w
