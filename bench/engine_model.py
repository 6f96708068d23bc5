"""The engine benchmarks' model: issue 13's random-init ~42M-parameter Llama (8 layers, hidden 512,
8 heads / 4 KV heads, 32k vocabulary, tied embeddings), built once and cached.

Kept apart from bench/run.py's model so the engine's figures stay comparable with the issue's
(transformers' generate and vLLM were measured on this shape).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

ENGINE_MODEL = dict(num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=4, intermediate_size=1536,
                    vocab_size=32000, max_position_embeddings=4096, seed=0, tie_word_embeddings=True)


def engine_model_dir() -> Path:
    """Build (once) and return the folder; the name hashes the shape, so a change rebuilds it."""
    from tandem.worker.local.toy_model import make_toy_model

    key = hashlib.sha256(json.dumps(ENGINE_MODEL, sort_keys=True).encode()).hexdigest()[:12]
    root = Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem"))
    return Path(make_toy_model(root / "models" / f"engine-llama42m-{key}", **ENGINE_MODEL))


def param_count() -> int:
    m = ENGINE_MODEL
    h, i, kv = m["hidden_size"], m["intermediate_size"], m["hidden_size"] // m["num_heads"] * m["num_kv_heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    head = 0 if m["tie_word_embeddings"] else m["vocab_size"] * h
    return m["num_layers"] * layer + m["vocab_size"] * h + head + h
