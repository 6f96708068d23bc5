"""Where a tensor-parallel rank reads its share of the weights from: the model's folder, or a hub
id's snapshot in HF_HOME's cache (hf/rank_loading.py reads only the rank's slices of its
safetensors files).
"""

from __future__ import annotations

from pathlib import Path

from tandem.worker.engine.errors import ModelLoadError


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
