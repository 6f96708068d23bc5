"""Whether a model can run with a prefill and a decode tensor-parallel size, judged once for the
worker (at start) and the operator (when an InferenceService is applied), with the same words.

A rank holds num_heads / tp query heads, so tp must divide the attention heads; its KV heads are
an equal share of the model's (tp divides them) or one head replicated (tp a multiple of them),
as vLLM shards them. Any two sizes that pass can hand KV over: every decode rank reads each of
its heads from a prefill rank that holds it (tandem.contracts.kv_layout.pull_slices). Torch-free.
"""

from __future__ import annotations

from tandem.contracts.kv_layout import tensor_parallel_problem


class ParallelismError(ValueError):
    """A tensor-parallel size the model's head counts do not allow; the message names the numbers."""


def tensor_parallel_problem_for(num_heads: int, num_kv_heads: int, tp: int, role: str = "") -> str | None:
    """Why one group of `tp` ranks cannot serve a model with these head counts, or None."""
    who = f"{role} " if role else ""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        return f"{who}tensor parallelism must be an integer >= 1, got {tp!r}"
    if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
        return (f"the model's head counts are inconsistent: {num_heads} attention heads, "
                f"{num_kv_heads} KV heads")
    if num_heads % tp:
        return (f"{who}tensor parallelism {tp} does not divide the model's {num_heads} attention heads "
                f"(choose a divisor of {num_heads})")
    problem = tensor_parallel_problem(num_kv_heads, tp)
    if problem is not None:
        return (f"{who}tensor parallelism {tp} cannot share the model's {num_kv_heads} KV heads: it must "
                f"divide them or be a multiple of them ({problem})")
    return None


def check_parallelism(num_heads: int, num_kv_heads: int, p: int, d: int) -> None:
    """Raise ParallelismError, naming the numbers, when prefill tensor parallelism `p` and decode
    tensor parallelism `d` cannot serve a model with `num_heads` attention heads and `num_kv_heads`
    KV heads (config.json's num_attention_heads and num_key_value_heads) and hand its KV over.
    A colocated worker is p == d."""
    for tp, role in ((p, "prefill"), (d, "decode")):
        problem = tensor_parallel_problem_for(num_heads, num_kv_heads, tp, role)
        if problem is not None:
            raise ParallelismError(problem)
