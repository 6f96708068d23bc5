"""The benchmarks' models: random-init Llamas built once and cached under ~/.cache/tandem/models/.

ENGINE_MODEL is issue 13's ~42M-parameter Llama (8 layers, hidden 512, 8 heads / 4 KV heads, 32k
vocabulary, tied embeddings): the engine scenarios use it as built (transformers' generate and vLLM
were measured on this shape), and the serving scenarios use it with its output head restricted to
tokens that decode to text (bench_model_dir); CURVES_MODEL is the same with an 8k context. MULTITURN_MODEL is the ~40M model with a 512-token
vocabulary of the multi-turn and chaos scenarios.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from tandem.worker.local.cache import cache_root

ENGINE_MODEL = dict(num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=4, intermediate_size=1536,
                    vocab_size=32000, max_position_embeddings=4096, seed=0, tie_word_embeddings=True)
# 8 x (attention 0.79M + MLP 4.13M) + embeddings and head 0.52M, fp32.
# The curves scenario's prompts reach 8k tokens (issue 23 point 5): the same weights, a longer context.
CURVES_MODEL = {**ENGINE_MODEL, "max_position_embeddings": 8192}
MULTITURN_MODEL = dict(num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=4, intermediate_size=2688,
                       vocab_size=512, max_position_embeddings=2048, seed=0)


def model_context(model_dir: Path) -> int:
    """The context length a model folder declares (config.json's max_position_embeddings)."""
    return int(json.loads((Path(model_dir) / "config.json").read_text())["max_position_embeddings"])


def engine_model_dir(max_positions: int | None = None) -> Path:
    """Build (once) and return ENGINE_MODEL's folder; the name hashes the shape, so a change rebuilds it.
    `max_positions`: the same model with a longer context (prefill at 8k tokens)."""
    from tandem.worker.local.toy_model import make_toy_model

    cfg = {**ENGINE_MODEL, "max_position_embeddings": max_positions or ENGINE_MODEL["max_position_embeddings"]}
    key = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:12]
    return Path(make_toy_model(cache_root() / "models" / f"engine-llama42m-{key}", **cfg))


def model_params(cfg: dict[str, Any]) -> int:
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_layers"]
    kv = h // cfg["num_heads"] * cfg["num_kv_heads"]
    heads = 1 if cfg.get("tie_word_embeddings") else 2
    return layers * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h) + heads * cfg["vocab_size"] * h + h


def kv_bytes_per_token(cfg: dict[str, Any], dtype: str = "float32") -> int:
    """K and V of every layer for one token."""
    size = 2 if dtype in ("bfloat16", "float16") else 4
    return 2 * cfg["num_layers"] * cfg["num_kv_heads"] * cfg["hidden_size"] // cfg["num_heads"] * size


# Run in a child process (this one, the load generator, never imports torch): zero the output
# head's rows of the tokens that decode to no complete text (lone UTF-8 bytes, special tokens).
# A random model picks such tokens often; their text is held back and the router sends no
# chunk for them, so two gaps would merge into one and look like a stall. With those rows at
# zero, greedy decoding never picks them (the best of ~350 random logits is always > 0) and
# every generated token reaches the client as its own chunk. The ids past the tokenizer's own
# (a 32k vocabulary over a few hundred learned tokens) decode to no text either. With tied
# embeddings the head is the embedding: its rows of tokens no prompt contains are zeroed; the
# matmul over the whole vocabulary, what the head costs, is unchanged.
RESTRICT_HEAD = """
import sys
from pathlib import Path
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
path = Path(sys.argv[1])
tok = Tokenizer.from_file(str(path / "tokenizer.json"))
n = tok.get_vocab_size()
bad = [i for i in range(n) if (t := tok.decode([i], skip_special_tokens=True)) == "" or "\ufffd" in t]
for f in sorted(path.glob("*.safetensors")):
    w = load_file(str(f))
    key = "lm_head.weight" if "lm_head.weight" in w else "model.embed_tokens.weight"
    if key in w:
        rows = bad + list(range(n, w[key].shape[0]))
        w[key][rows] = 0.0
        save_file(w, str(f), metadata={"format": "pt"})
        print(f"output head restricted: {len(rows)} of {w[key].shape[0]} tokens never generated")
"""
HEAD_MARKER = ".bench-head-restricted"
BUILD = ("import json,sys; from tandem.worker.local.toy_model import make_toy_model; "
         "make_toy_model(sys.argv[1], **json.loads(sys.argv[2]))")


def bench_model_dir(cfg: dict[str, Any]) -> Path:
    """A serving benchmark's model, its head restricted to tokens with text, built once (in child
    processes: the load generator never imports torch)."""
    from bench.lib.processes import BenchProcess

    key = hashlib.sha256(json.dumps({**cfg, "head": "complete-text"}, sort_keys=True).encode())
    path = cache_root() / "models" / f"bench-llama-{key.hexdigest()[:12]}"
    if not (path / HEAD_MARKER).is_file():
        print(f"building the benchmark model at {path} ...", flush=True)
        log = path.parent / f"{path.name}.build.log"
        for name, argv in (("build", [BUILD, str(path), json.dumps(cfg)]), ("restrict-head", [RESTRICT_HEAD, str(path)])):
            BenchProcess(name, "", "", [sys.executable, "-c", *argv], None, log).run_to_end(600)
        (path / HEAD_MARKER).write_text("lm_head rows of tokens without complete text zeroed\n")
    return path
