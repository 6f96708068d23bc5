"""Tensor and expert parallelism for the transformers path: the model's own classes split across the
ranks of a group by the model's own plan (transformers' `base_model_tp_plan`: which linears split
by output rows, "colwise", and which by input columns, "rowwise"), with routed experts split whole
over the same ranks (expert parallelism, the plan's `base_model_ep_plan`).

- attention: each rank keeps its query heads and its KV heads (an equal share, or one replicated,
  as contracts/kv_layout.py places them), so its pool holds exactly its heads; o_proj sums the
  ranks' partial products (one all-reduce);
- dense MLPs: gate/up by rows, down by columns (one all-reduce);
- experts: each rank holds num_experts / size whole experts and runs them on the whole batch,
  the routes to other ranks' experts masked, and one all-reduce sums the ranks' parts (what
  transformers' AllReduceEP does; every rank holds the same batch here);
- embedding, norms, router and output head stay whole on every rank.

A plan that splits attention another way (a packed qkv gathered whole, a norm over all heads) or
uses another style is refused: each rank's pool must hold only its own heads.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
from tandem.contracts.kv_layout import kv_heads_of_rank
from tandem.worker.engine.hf.packed_linears import FlatPackedLinear
from tandem.worker.engine.parallel.layers import RowParallelLinear
from torch import nn

HEAD_SPLIT = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
REPLICATED = "replicated_with_grad_allreduce"  # per-head q/k norms: every rank applies them whole
EXPERT_STYLES = ("grouped_gemm", "ep_dispatch_experts")


class TensorParallelError(ValueError):
    """The model's plan cannot be split so that each rank's pool holds only its heads."""


def _tp_styles(model: Any) -> tuple[dict[str, str], dict[str, str]]:
    cfg = model.config.get_text_config()
    tp = dict(getattr(cfg, "base_model_tp_plan", None) or {})
    ep = dict(getattr(cfg, "base_model_ep_plan", None) or {})
    if not all(any(k.endswith(name) and v == ("rowwise" if name.endswith("o_proj") else "colwise")
                   for k, v in tp.items()) for name in HEAD_SPLIT):
        raise TensorParallelError(f"{type(model).__name__}'s tensor-parallel plan does not split attention by heads "
                                  "(q/k/v by output rows, o by input columns)")
    experts = {k for k, v in ep.items() if v == "ep_dispatch_experts"}
    dense = {k: v for k, v in tp.items() if not any(k.startswith(e) for e in experts)}
    if unknown := sorted({v for v in dense.values()} - {"colwise", "rowwise", REPLICATED}):
        raise TensorParallelError(f"{type(model).__name__}'s tensor-parallel plan uses {', '.join(unknown)}")
    if any(v not in EXPERT_STYLES for v in ep.values()):
        raise TensorParallelError(f"{type(model).__name__}'s expert-parallel plan is not whole experts per rank")
    return dense, {k: v for k, v in ep.items() if k in experts}


def _rows(model: Any, name: str, out: int, group: Any) -> torch.Tensor:
    """The output rows this rank keeps of linear `name` (`out` rows in all)."""
    cfg = model.config.get_text_config()
    if name.endswith(("self_attn.k_proj", "self_attn.v_proj")):
        kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        d = out // kv
        heads = kv_heads_of_rank(kv, group.size, group.rank)
        return torch.arange(heads.start * d, heads.stop * d)
    if out % group.size:
        raise TensorParallelError(f"{name}: {out} rows do not split into {group.size} equal parts")
    per = out // group.size
    return torch.arange(group.rank * per, (group.rank + 1) * per)


class LocalExperts(nn.Module):
    """This rank's experts run on the whole batch; routes to other ranks' experts are masked (the
    experts' sentinel id, weight 0) and the ranks' outputs summed."""

    def __init__(self, experts: nn.Module, group: Any):
        super().__init__()
        total = experts.num_experts
        if total % group.size:
            raise TensorParallelError(f"{total} experts do not split into {group.size} equal parts")
        self.per = total // group.size
        self.first = group.rank * self.per
        for name, p in list(experts.named_parameters(recurse=False)):
            if p.shape[0] == total:
                setattr(experts, name, nn.Parameter(p.data[self.first:self.first + self.per].clone(),
                                                    requires_grad=False))
        experts.num_experts = self.per
        experts._is_expert_parallel = True  # the grouped kernels then skip the sentinel rows
        self.experts = experts
        self.group = group

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        off = (top_k_index < self.first) | (top_k_index >= self.first + self.per)
        local = torch.where(off, self.per, top_k_index - self.first)
        out = self.experts(hidden_states, local, top_k_weights.masked_fill(off, 0.0))
        return self.group.all_reduce(out)


def shard_model(model: nn.Module, group: Any) -> int:
    """Split `model` (a loaded transformers causal LM) across `group` in place; returns how many
    modules were split. Raises TensorParallelError for a plan this cannot honour."""
    if group is None or group.size == 1:
        return 0
    dense, experts = _tp_styles(model)
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    swaps: list[tuple[str, nn.Module]] = []
    for name, module in base.named_modules():
        style = next((v for k, v in dense.items() if fnmatch.fnmatchcase(name, k)), None)
        if style in ("colwise", "rowwise") and type(module) is nn.Linear:
            w, b = module.weight.detach(), None if module.bias is None else module.bias.detach()
            if style == "colwise":
                rows = _rows(model, name, w.shape[0], group)
                swaps.append((name, FlatPackedLinear(w[rows].contiguous(), None if b is None else b[rows])))
            else:
                cols = _rows(model, name, w.shape[1], group)
                swaps.append((name, RowParallelLinear(FlatPackedLinear(w[:, cols].contiguous()), group, b)))
        elif style in ("colwise", "rowwise"):
            raise TensorParallelError(f"{name} is a {type(module).__name__}, not a plain linear layer")
        elif any(fnmatch.fnmatchcase(name, k) for k in experts):
            swaps.append((name, LocalExperts(module, group)))
    for name, new in swaps:
        parent, _, child = name.rpartition(".")
        setattr(base.get_submodule(parent) if parent else base, child, new)
    return len(swaps)
