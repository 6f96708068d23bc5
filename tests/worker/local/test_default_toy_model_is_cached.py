"""Without --model, `tandem up` builds its toy model once and reuses it from the cache."""

from __future__ import annotations

import json

from tandem.worker.local import up


def test_toy_model_built_once_under_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    first = up.toy_model_dir()
    assert first.parent == tmp_path / "models"
    cfg = json.loads((first / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"]) == (up.DEFAULT_TOY["num_layers"], up.DEFAULT_TOY["hidden_size"])
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert up.toy_model_dir() == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
