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

`rank_splits` lists a rank's splits (from shapes alone: the model may be on the meta device), `narrow`
keeps only its part of each split module, `checkpoint_part` says which part of a checkpoint tensor
it reads (hf/rank_loading.py loads a rank from these), and `wrap` adds each part's collective.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
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


def _rows(model: Any, name: str, out: int, group: Any) -> slice:
    """The output rows this rank keeps of linear `name` (`out` rows in all)."""
    cfg = model.config.get_text_config()
    if name.endswith(("self_attn.k_proj", "self_attn.v_proj")):
        kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        d = out // kv
        heads = kv_heads_of_rank(kv, group.size, group.rank)
        return slice(heads.start * d, heads.stop * d)
    if out % group.size:
        raise TensorParallelError(f"{name}: {out} rows do not split into {group.size} equal parts")
    per = out // group.size
    return slice(group.rank * per, (group.rank + 1) * per)


@dataclass(frozen=True)
class Split:
    """How one module of the model is split: a linear by output rows ("colwise") or input columns
    ("rowwise"), or routed experts whole ("experts": the experts this rank holds); `name` is its
    name in the causal LM (as in the checkpoint), `part` the rows, columns or experts kept."""

    name: str
    style: str
    part: slice


def rank_splits(model: nn.Module, group: Any) -> list[Split]:
    """Every split of `model` on this rank of `group` (none with one rank), from the model's own plan;
    the model may be on the meta device (only shapes are read). Raises TensorParallelError for a
    plan this cannot honour."""
    if group is None or group.size == 1:
        return []
    dense, experts = _tp_styles(model)
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    prefix = next(n for n, m in model.named_modules() if m is base)
    prefix = f"{prefix}." if prefix else ""
    splits = []
    for name, module in base.named_modules():
        style = next((v for k, v in dense.items() if fnmatch.fnmatchcase(name, k)), None)
        if style in ("colwise", "rowwise") and type(module) is nn.Linear:
            out, cols = module.weight.shape
            part = _rows(model, name, out if style == "colwise" else cols, group)
            splits.append(Split(prefix + name, style, part))
        elif style in ("colwise", "rowwise"):
            raise TensorParallelError(f"{name} is a {type(module).__name__}, not a plain linear layer")
        elif any(fnmatch.fnmatchcase(name, k) for k in experts):
            total = module.num_experts
            if total % group.size:
                raise TensorParallelError(f"{total} experts do not split into {group.size} equal parts")
            per = total // group.size
            splits.append(Split(prefix + name, "experts", slice(group.rank * per, (group.rank + 1) * per)))
    return splits


def part_of(p: torch.Tensor, split: Split, param: str) -> torch.Tensor:
    """This rank's part of parameter `param` of the split module (a copy; shapes only on meta)."""
    if split.style == "colwise":
        return p[split.part]
    if split.style == "rowwise":
        return p if param == "bias" else p[:, split.part]  # the bias is added once, after the sum
    return p[split.part]  # experts: the first axis


def narrow(model: nn.Module, splits: list[Split]) -> None:
    """Keep only this rank's part of every split module's parameters, in place: on the meta device
    this shapes the model for loading just those parts (hf/rank_loading.py)."""
    for split in splits:
        module = model.get_submodule(split.name)
        for pname, p in list(module.named_parameters(recurse=False)):
            if split.style == "experts" and p.shape[0] != module.num_experts:
                continue
            setattr(module, pname, nn.Parameter(part_of(p.data, split, pname).contiguous(), requires_grad=False))
        if split.style == "experts":
            module.num_experts = split.part.stop - split.part.start


def checkpoint_part(key: str, splits: list[Split]) -> tuple[Split | None, bool]:
    """For a checkpoint tensor: the linear split it belongs to (None: read whole) and whether this
    rank reads it at all (a routed expert that another rank holds: no; every layer's experts are
    split alike, and the model's own conversion stacks the ones read)."""
    owner = key.rpartition(".")[0]
    if (m := EXPERT_KEY.match(key)) is not None:
        part = next((s.part for s in splits if s.style == "experts"), None)
        return None, part is None or part.start <= int(m.group(1)) < part.stop
    return next((s for s in splits if s.style != "experts" and s.name == owner), None), True


EXPERT_KEY = re.compile(r"^.*\.experts\.(\d+)\.")  # a checkpoint's per-expert tensors


class LocalExperts(nn.Module):
    """This rank's experts (narrowed to them) run on the whole batch; routes to other ranks' experts
    are masked (the experts' sentinel id, weight 0) and the ranks' outputs summed."""

    def __init__(self, experts: nn.Module, part: slice, group: Any):
        super().__init__()
        self.first, self.per = part.start, part.stop - part.start
        experts._is_expert_parallel = True  # the grouped kernels then skip the sentinel rows
        self.experts = experts
        self.group = group

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        off = (top_k_index < self.first) | (top_k_index >= self.first + self.per)
        local = torch.where(off, self.per, top_k_index - self.first)
        out = self.experts(hidden_states, local, top_k_weights.masked_fill(off, 0.0))
        return self.group.all_reduce(out)


def wrap(model: nn.Module, splits: list[Split], group: Any) -> None:
    """Give each narrowed module the collective its part needs, in place: a column split is a plain
    linear over its rows, a row split sums the ranks' products, local experts sum the ranks' outputs."""
    for split in splits:
        module = model.get_submodule(split.name)
        if split.style == "experts":
            new: nn.Module = LocalExperts(module, split.part, group)
        else:
            b = None if module.bias is None else module.bias.detach()
            new = (FlatPackedLinear(module.weight.detach(), b) if split.style == "colwise"
                   else RowParallelLinear(FlatPackedLinear(module.weight.detach()), group, b))
        parent, _, child = split.name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
