"""Which slice of each weight a rank loads: pure arithmetic over the model's shape, no tensors.

Megatron-style tensor parallelism, as vLLM and SGLang shard Llama-family models:
- column-parallel (the output dimension split): q, k, v (by heads), gate and up (by rows of the
  intermediate size); each rank computes its heads or its part of the MLP alone;
- row-parallel (the input dimension split): o and down; their partial products are summed over
  the ranks, one all-reduce after attention and one after the MLP;
- vocabulary-parallel: the embedding's and the output head's rows; the embedding's lookups are
  summed over the ranks (each rank contributes the rows it holds), the head's logits gathered.
KV heads follow tandem.contracts.kv_layout (an equal share, or one head replicated).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.contracts.kv_layout import kv_heads_of_rank
from tandem.contracts.parallelism import ParallelismError, tensor_parallel_problem_for


@dataclass(frozen=True)
class Span:
    """Rows (or columns) start..stop of a weight."""

    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def even_span(total: int, rank: int, size: int) -> Span:
    """An equal 1/size share of `total` (which size divides)."""
    per = total // size
    return Span(rank * per, (rank + 1) * per)


@dataclass(frozen=True)
class Shard:
    """One rank's share of a model with these dimensions."""

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    def __post_init__(self) -> None:
        problem = tensor_parallel_problem_for(self.num_heads, self.num_kv_heads, self.size)
        if problem is None and self.intermediate % self.size:
            problem = (f"tensor parallelism {self.size} does not divide the model's intermediate size "
                       f"{self.intermediate}")
        if problem is not None:
            raise ParallelismError(problem)

    @property
    def q_heads(self) -> Span:
        return even_span(self.num_heads, self.rank, self.size)

    @property
    def kv_heads(self) -> Span:
        heads = kv_heads_of_rank(self.num_kv_heads, self.size, self.rank)
        return Span(heads.start, heads.stop)

    def q_rows(self) -> Span:
        """Rows of q_proj (and columns of o_proj): this rank's query heads."""
        h = self.q_heads
        return Span(h.start * self.head_dim, h.stop * self.head_dim)

    def kv_rows(self) -> Span:
        """Rows of k_proj and v_proj: this rank's KV heads."""
        h = self.kv_heads
        return Span(h.start * self.head_dim, h.stop * self.head_dim)

    def mlp_rows(self) -> Span:
        """Rows of gate_proj and up_proj (and columns of down_proj)."""
        return even_span(self.intermediate, self.rank, self.size)

    @property
    def vocab_chunk(self) -> int:
        """Rows of the vocabulary per rank; the last rank's share is padded up to it."""
        return -(-self.vocab // self.size)

    def vocab_rows(self) -> Span:
        """Rows of the embedding and the output head this rank holds (the last may hold fewer)."""
        start = min(self.vocab, self.rank * self.vocab_chunk)
        return Span(start, min(self.vocab, start + self.vocab_chunk))


def config_problem(config: dict[str, Any], tp: int) -> str | None:
    """Why a model (its config.json) cannot be split over `tp` ranks, or None: checked before any
    rank starts, with the numbers."""
    heads = int(config.get("num_attention_heads") or 0)
    kv = int(config.get("num_key_value_heads") or heads)
    problem = tensor_parallel_problem_for(heads, kv, tp)
    inter = int(config.get("intermediate_size") or 0)
    if problem is None and inter % tp:
        problem = f"tensor parallelism {tp} does not divide the model's intermediate size {inter}"
    return problem
