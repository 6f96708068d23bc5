"""The transformers path's decode step as one compiled graph, the model's own classes inside it.

A step of decode tokens only calls the model's forward with a `DecodeOnly` in place of the
PagedStep. Each decoder layer then runs as a nested compile region (compiled once, called by
every layer with its own weights and its own layer of the pool, so a 30-layer model compiles
about what a 1-layer one does). Its attention reads the pool and writes nothing: the token attends to its own new K/V beside the cached ones (attention.py's
paged_decode_attention) and hands them back; the runner writes them into their slots with one
indexed copy after the graph. Compiled at start-up with the batch size and the block-table width
dynamic (decode_step.StepGraphs), never inside a request.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from tandem.worker.engine.attention import paged_decode_attention
from tandem.worker.engine.decode_step import (
    StepGraphs,
    own_code,
    step_compile_options,
    step_example,
)

STEP_KWARG = "tandem_step"  # the model forward's keyword that carries a step to every layer


@torch.library.custom_op("tandem::materialized", mutates_args=())
def materialized(x: torch.Tensor) -> torch.Tensor:
    """x copied, opaque to inductor: what it is computed from (a model's rotary embedding: the cos
    and sin of its positions) is computed once into memory, not again inside every loop that reads
    it (the attention reads each query once per cached position: 7.6 ms a layer instead of 4.9 at
    32 streams of 512 tokens)."""
    return x.clone()


@materialized.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@dataclass
class DecodeOnly:
    """The decode step as the model's forward carries it to its layers: the pool, read-only."""

    pool: torch.Tensor  # [blocks, kv_heads, layers, 2, block_size, head_dim]
    windows: list[int | None]  # each layer's sliding window (paged_attention.layer_windows)
    tables: torch.Tensor  # [B, width]
    cached: torch.Tensor  # [B]: tokens already in the pool (each token's own position)
    new_kv: list[torch.Tensor] = field(default_factory=list)  # each layer's [B, kv_heads, 2, d]


@dataclass
class LayerDecode:
    """One layer's share of the decode step, inside its compile region."""

    pool_layer: torch.Tensor  # [blocks, kv_heads, 2, block_size, head_dim]
    window: int | None
    tables: torch.Tensor
    cached: torch.Tensor
    new_kv: torch.Tensor | None = None


def decode_attention(step: LayerDecode, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scale: float, softcap: float | None) -> torch.Tensor:
    """query [1, H, B, d], key/value [1, KV, B, d] -> [1, B, H, d]; the layer's new K/V kept."""
    q, k, v = (materialized(t[0].transpose(0, 1)) for t in (query, key, value))  # [B, heads, d]
    step.new_kv = torch.stack([k, v], dim=2)
    return paged_decode_attention(q, step.pool_layer, step.tables, step.cached, scale, k, v, step.window,
                                  softcap)[None]


def decode_layer(layer: torch.nn.Module, hidden: torch.Tensor, pool_layer: torch.Tensor, window: int | None,
                 tables: torch.Tensor, cached: torch.Tensor, kwargs: dict[str, Any]) -> tuple[Any, torch.Tensor]:
    """One decoder layer (the model's own forward) over the decode batch: its output and new K/V."""
    step = LayerDecode(pool_layer, window, tables, cached)
    out = type(layer).forward(layer, hidden, **kwargs, **{STEP_KWARG: step})
    assert step.new_kv is not None
    return out, step.new_kv


def layer_forward(region: Any, layer: torch.nn.Module, li: int, hidden: torch.Tensor, *args: Any, **kwargs: Any
                  ) -> Any:
    """A decoder layer's forward: in the decode step, its compile region over the layer's part of
    the pool (the new K/V collected for the runner); otherwise the model's own forward."""
    step = kwargs.get(STEP_KWARG)
    if not isinstance(step, DecodeOnly):
        return type(layer).forward(layer, hidden, *args, **kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k != STEP_KWARG}
    out, kv = region(layer, hidden, step.pool[:, :, li], step.windows[li], step.tables, step.cached, kwargs)
    step.new_kv.append(kv)
    return out


def decoder_layers(model: Any) -> list[torch.nn.Module] | None:
    """The model's decoder layers in order, where it keeps them as one list (`layers`)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(base, "layers", None)
    return list(layers) if isinstance(layers, torch.nn.ModuleList) else None


def decode_forward(model: Any, windows: list[int | None], ids: torch.Tensor, positions: torch.Tensor,
                   tables: torch.Tensor, pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, positions [B]; tables [B, width]. Logits [B, vocab] (float32), their argmax, and the
    new K/V [B, kv_heads, layers, 2, d] (the pool's order)."""
    step = DecodeOnly(pool, windows, tables, positions)
    out = model(input_ids=ids[None], position_ids=positions[None], use_cache=False, **{STEP_KWARG: step})
    logits = out.logits[0].float()
    return logits, logits.argmax(-1), torch.stack(step.new_kv, dim=2)


class CompiledDecode(StepGraphs):
    """The transformers path's decode step, compiled (`decode_step`) or not (None: the runner's
    eager forward runs every step)."""

    name = "the transformers path's decode step"

    def __init__(self, model: Any, windows: list[int | None], enabled: bool):
        self.enabled = enabled
        super().__init__()
        self.decode_step: Any = None
        if enabled:
            region = torch.compiler.nested_compile_region(own_code(decode_layer))
            for li, layer in enumerate(decoder_layers(model) or ()):
                layer.forward = functools.partial(layer_forward, region, layer, li)
            step = functools.partial(own_code(decode_forward), model, windows)
            self.decode_step = torch.compile(step, dynamic=False, fullgraph=True, options=step_compile_options())

    def _trace(self, pool: torch.Tensor, batch: int, width: int) -> None:
        self.decode_step(*step_example(pool, batch, width), pool)


def decode_graphs(model: Any, windows: list[int | None], enabled: bool, block_size: int) -> CompiledDecode:
    """One CompiledDecode per model, setting and block size (the graphs are compiled for one):
    engines over the same loaded model (tests build many) share its graphs, compiled once."""
    cache = model.__dict__.setdefault("_tandem_decode", {})
    if (enabled, block_size) not in cache:
        cache[enabled, block_size] = CompiledDecode(model, windows, enabled)
    return cache[enabled, block_size]
