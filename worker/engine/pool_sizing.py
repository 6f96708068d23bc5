"""How many KV blocks the pool gets and how long a context that allows, from the settings, the model
and the memory left after loading it."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from tandem.contracts.kv_layout import KVLayout
from tandem.worker.engine.config import EngineConfig
from tandem.worker.engine.errors import ModelLoadError
from tandem.worker.engine.loader import LoadedModel

log = logging.getLogger("tandem.worker.engine")


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def size_pool(config: EngineConfig, lm: LoadedModel) -> tuple[KVLayout, int]:
    """(the pool's layout, the context length): num_blocks as set, or a fraction of the free memory
    (on a CPU no more than every sequence at full context); the context capped to what the pool
    holds. ModelLoadError when not one block fits."""
    probe = kv_layout_for(lm.config, 1, config.block_size, lm.dtype, lm.group)
    num_blocks = config.num_blocks
    if num_blocks is None:
        default_fraction = 0.9 if lm.device.type == "cuda" else 0.25
        fraction = config.kv_memory_fraction or default_fraction
        num_blocks = int(_available_memory(lm.device) * fraction) // probe.block_bytes
        # On a CPU there is no point in more than every sequence at full context.
        if lm.device.type == "cpu" and config.kv_memory_fraction is None:
            num_blocks = min(num_blocks, config.max_num_seqs * probe.blocks_for(lm.max_model_len))
    if num_blocks < 1:
        raise ModelLoadError("no memory left for the KV pool; lower kv_memory_fraction or set num_blocks")
    layout = kv_layout_for(lm.config, num_blocks, config.block_size, lm.dtype, lm.group)
    max_model_len = lm.max_model_len
    if config.max_model_len is not None:
        max_model_len = min(config.max_model_len, lm.max_model_len)
    if max_model_len > num_blocks * config.block_size:
        log.warning("context length capped from %d to %d tokens: the KV pool holds only %d blocks of %d",
                    max_model_len, num_blocks * config.block_size, num_blocks, config.block_size)
        max_model_len = num_blocks * config.block_size
    return layout, max_model_len


def kv_layout_for(config, num_blocks: int, block_size: int, dtype: torch.dtype, group: Any = None) -> KVLayout:
    """The pool layout of a model on one rank (`group`: its tensor-parallel group; None: alone)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return KVLayout(
        num_blocks=num_blocks,
        num_layers=config.num_hidden_layers,
        block_size=block_size,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,  # MHA configs name none
        head_dim=head_dim,
        dtype=str(dtype).removeprefix("torch."),
        tp_size=group.size if group is not None else 1,
        tp_rank=group.rank if group is not None else 0,
    )
