"""Reading a rank's slices of the weights, by Hugging Face name: from the safetensors files (each
rank reads only its rows or columns, never the whole model: safetensors' get_slice reads just
those bytes from the memory-mapped file), or from a transformers module already loaded (one rank:
views of its tensors, no copy).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from tandem.worker.engine.errors import ModelLoadError
from tandem.worker.engine.parallel.sharding import Span
from torch import nn

log = logging.getLogger("tandem.worker.engine.parallel")


class CheckpointReader:
    """Slices of the tensors in a folder's safetensors files, cast to `dtype` on `device`."""

    def __init__(self, folder: str | Path, dtype: torch.dtype, device: torch.device):
        from safetensors import safe_open

        self.folder, self.dtype, self.device = Path(folder), dtype, device
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
            weight_map = None
        if not files:
            raise ModelLoadError(f"no safetensors weights in {self.folder}: tensor parallelism reads each "
                                 "rank's slices from *.safetensors files")
        self._files = {name: safe_open(str(self.folder / name), framework="pt") for name in files}
        self._where: dict[str, str] = weight_map or {
            key: name for name, f in self._files.items() for key in f.keys()}
        self.bytes_read = 0

    def has(self, name: str) -> bool:
        return name in self._where

    def _slice(self, name: str) -> Any:
        try:
            return self._files[self._where[name]].get_slice(name)
        except KeyError:
            raise ModelLoadError(f"{self.folder}: the checkpoint has no tensor {name!r}") from None

    def _out(self, t: torch.Tensor) -> torch.Tensor:
        self.bytes_read += t.numel() * t.element_size()
        return t.to(device=self.device, dtype=self.dtype).contiguous()

    def full(self, name: str) -> torch.Tensor:
        return self._out(self._slice(name)[:])

    def rows(self, name: str, span: Span) -> torch.Tensor:
        return self._out(self._slice(name)[span.start:span.stop])

    def cols(self, name: str, span: Span) -> torch.Tensor:
        return self._out(self._slice(name)[:, span.start:span.stop])

    def fused_rows(self, names: list[str], spans: list[Span]) -> torch.Tensor:
        """The row slices of several tensors, concatenated (q, k and v; gate and up)."""
        return torch.cat([self.rows(n, s) for n, s in zip(names, spans, strict=True)])


class ModuleReader:
    """The same slices, as views of a loaded transformers module's own tensors (one rank)."""

    def __init__(self, module: nn.Module):
        self.module = module
        self._tensors = dict(module.named_parameters()) | dict(module.named_buffers())

    def has(self, name: str) -> bool:
        return name in self._tensors

    def full(self, name: str) -> torch.Tensor:
        return self._tensors[name].detach()

    def rows(self, name: str, span: Span) -> torch.Tensor:
        return self.full(name)[span.start:span.stop]

    def cols(self, name: str, span: Span) -> torch.Tensor:
        return self.full(name)[:, span.start:span.stop]

    def fused_rows(self, names: list[str], spans: list[Span]) -> torch.Tensor:
        """Whole tensors are fused in place: each module's weight then becomes a view into the
        result, so the model keeps working and memory holds one copy."""
        if any(s.start != 0 or s.stop != self._tensors[n].shape[0] for n, s in zip(names, spans, strict=True)):
            return torch.cat([self.rows(n, s) for n, s in zip(names, spans, strict=True)])
        fused = torch.cat([self.full(n) for n in names])
        row = 0
        for n in names:
            owner, attr = n.rsplit(".", 1)
            size = self._tensors[n].shape[0]
            view = nn.Parameter(fused[row:row + size], requires_grad=False)
            setattr(self.module.get_submodule(owner), attr, view)
            self._tensors[n] = view
            row += size
        return fused


def local_checkpoint(model: str) -> Path:
    """The folder holding a model's safetensors: the folder itself, or a hub id's snapshot in
    HF_HOME's cache (never downloaded here: the weights are delivered before the worker starts)."""
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as e:  # noqa: BLE001 - any failure means the same: no local weights
        raise ModelLoadError(f"no local safetensors for {model!r} (a folder, or a hub id cached in "
                             f"HF_HOME): {e}") from e
