"""Whether a model can be split over a tensor-parallel group, from its config.json alone: pure
arithmetic over its shape, checked before any rank starts (rank_zero.py). How the split is made
is the model's own plan (hf/tensor_parallel.py); KV heads follow tandem.contracts.kv_layout.
"""

from __future__ import annotations

from typing import Any

from tandem.contracts.parallelism import tensor_parallel_problem_for


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
