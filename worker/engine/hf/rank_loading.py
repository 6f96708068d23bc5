"""A tensor-parallel rank of the transformers path loads only its share of the model: the model's own
classes are built on the meta device (no memory), narrowed to this rank's heads, MLP rows and
experts by the model's plan (hf/tensor_parallel.py), and then filled from the safetensors files
by transformers' own loading (its key renames and conversions, such as the per-expert tensors
stacked into one), fed only this rank's slices: a split linear's rows or columns are read with
safetensors' `get_slice` (just those bytes of the memory-mapped file) and another rank's experts
are never read. No rank ever holds the whole model; embedding, norms, routers and the head are
whole on every rank, as the plan keeps them.

transformers 5's loader is driven through `convert_and_load_state_dict_in_model` and the model's
`_finalize_model_loading` (non-persistent buffers such as the rotary frequencies, tied heads),
the two steps `from_pretrained` runs after it has built the meta model; transformers is pinned
(pyproject.toml), and tests/worker/parallel/test_transformers_rank_loads_only_its_share.py checks
the result against the whole model's slices.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from tandem.worker.engine.errors import ModelLoadError
from tandem.worker.engine.hf.tensor_parallel import (
    Split,
    checkpoint_part,
    narrow,
    part_of,
    rank_splits,
    wrap,
)

log = logging.getLogger("tandem.worker.engine")


class _Part:
    """A checkpoint tensor as transformers' loader reads it (`t[...]`), giving only this rank's part."""

    def __init__(self, tensor: Any, split: Split | None, param: str, meter: list[int]):
        self.tensor, self.split, self.param, self.meter = tensor, split, param, meter

    def __getitem__(self, _: Any) -> torch.Tensor:
        part = self.tensor if self.split is None else part_of(self.tensor, self.split, self.param)
        t = part if isinstance(part, torch.Tensor) else part[...]
        self.meter[0] += t.numel() * t.element_size()
        return t


def _files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no safetensors weights in {folder}: a tensor-parallel rank reads its share "
                             "from *.safetensors files")
    return files


def load_rank_model(folder: str | Path, config: Any, dtype: torch.dtype, device: torch.device, group: Any,
                    attn_implementation: str, trust_remote_code: bool = False) -> tuple[Any, int]:
    """This rank's model: the causal LM narrowed to its share, loaded, with its collectives in place;
    and how many bytes of tensors it read from the checkpoint."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation,
                                                 trust_remote_code=trust_remote_code)
    splits = rank_splits(model, group)
    narrow(model, splits)
    meter = [0]
    handles = [safe_open(str(f), framework="pt", backend="mmap") for f in _files(Path(folder))]
    state: dict[str, _Part] = {}
    for handle in handles:
        for key in handle.keys():
            split, wanted = checkpoint_part(key, splits)
            if wanted:
                state[key] = _Part(handle.get_slice(key), split, key.rpartition(".")[2], meter)
    load = LoadStateDictConfig(pretrained_model_name_or_path=str(folder), device_map={"": device}, dtype=dtype,
                               weight_mapping=get_model_conversion_mapping(model))
    info, _ = convert_and_load_state_dict_in_model(model, state, load)
    if info.mismatched_keys or info.conversion_errors or info.error_msgs:
        raise ModelLoadError(f"{folder}: this rank's share of the checkpoint does not fit the model narrowed by its "
                             f"tensor-parallel plan: {sorted(info.mismatched_keys)[:3]} {info.conversion_errors} "
                             f"{info.error_msgs[:3]}")
    type(model)._finalize_model_loading(model, load, info)
    tied = bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
    if missing := [k for k in info.missing_keys if not (tied and "lm_head" in k)]:  # a tied head is the embedding
        raise ModelLoadError(f"{folder}: the checkpoint lacks {', '.join(sorted(missing)[:5])}")
    wrap(model, splits, group)
    model.eval()
    log.info("rank %d of %d read %.1f MiB of the checkpoint (its heads, MLP rows and experts; the rest whole)",
             group.rank, group.size, meter[0] / 2**20)
    return model, meter[0]
