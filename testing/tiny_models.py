"""Tiny random-weight models of every architecture the tests check, from transformers' own config
classes, saved in Hugging Face format with the toy tokenizer (worker/local/toy_model.py).

Each config is small (2-4 layers, hidden 64) but switches on what makes its architecture differ
from Llama, so a test that matches transformers' generate on it proves the feature: sliding
windows shorter than the test prompts (Mistral, and mixed local/global layers in Qwen2 and
Gemma 3, whose two layer kinds also rotate differently), QK-norm (Qwen3), q/k/v biases (Qwen2),
partial rotary and fused projections (Phi-3), tied and untied heads, final logit soft-capping
(Gemma 3) and routed experts (Mixtral, Qwen3-MoE).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

MARKER = ".tandem-tiny-complete"
WINDOW = 8  # tokens: the sliding windows below, shorter than the tests' prompts
VOCAB = 512
# What every tiny config shares; initializer_range above the usual 0.02 spreads the logits so
# greedy decoding has no near-ties for two correct implementations to break differently.
COMMON: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                              initializer_range=0.15)


def _llama(**ids: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**COMMON, **ids, tie_word_embeddings=True,
                       rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 64})


def _mistral(**ids: int) -> Any:
    from transformers import MistralConfig

    return MistralConfig(**COMMON | {"num_key_value_heads": 1}, **ids, head_dim=32, sliding_window=WINDOW)


def _qwen2(**ids: int) -> Any:
    from transformers import Qwen2Config

    # Layer 0 attends fully, layer 1 within the window (layers from max_window_layers on slide).
    return Qwen2Config(**COMMON, **ids, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                       tie_word_embeddings=False)


def _qwen3(**ids: int) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(**COMMON, **ids, head_dim=16, tie_word_embeddings=True)


def _gemma3(**ids: int) -> Any:
    from transformers import Gemma3TextConfig

    # Layers 0 and 2 local (window, their own rotary base), layer 1 global; the head soft-caps logits.
    # Untied: Gemma scales its embedding by sqrt(hidden), so with a tied random head every position
    # would predict its own input token (greedy output one repeated token, telling nothing).
    return Gemma3TextConfig(**COMMON | {"num_hidden_layers": 3}, **ids, head_dim=16, sliding_window=WINDOW,
                            sliding_window_pattern=2, query_pre_attn_scalar=24, final_logit_softcapping=5.0,
                            rope_local_base_freq=100.0, tie_word_embeddings=False)


def _phi3(**ids: int) -> Any:
    from transformers import Phi3Config

    return Phi3Config(**COMMON, **ids, partial_rotary_factor=0.5, tie_word_embeddings=False)


def _mixtral(**ids: int) -> Any:
    from transformers import MixtralConfig

    return MixtralConfig(**COMMON, **ids, num_local_experts=4, num_experts_per_tok=2)


def _qwen3_moe(**ids: int) -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**COMMON, **ids, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                          decoder_sparse_step=1, norm_topk_prob=True)


# Test id -> the config it builds. "gemma3" is Gemma 3's text model (model_type gemma3_text, as
# the 1B checkpoint ships); the larger checkpoints wrap it with a vision tower.
ARCHITECTURES: dict[str, Callable[..., Any]] = {
    "llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "qwen3": _qwen3, "gemma3": _gemma3,
    "phi3": _phi3, "mixtral": _mixtral, "qwen3_moe": _qwen3_moe,
}


# Further families, each with a generic tiny config: transformers' own config class with the sizes
# below where it has such a field (so sliding windows shrink to WINDOW and heads untie), and its own
# defaults otherwise. Together with ARCHITECTURES, every type on the transformers path of
# contracts/model_support.py.
GENERIC_SIZES: dict[str, Any] = COMMON | dict(
    head_dim=16, sliding_window=WINDOW, tie_word_embeddings=False, moe_intermediate_size=32, num_experts=4,
    num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=32)


# Weights drawn from another seed where seed 0's tiny model has two logits equal to float32's
# precision at some test position (greedy output would then hinge on rounding, not on the model).
SEEDS = {"cohere": 1}


def generic_config(model_type: str, **ids: int) -> Any:
    """A tiny config of any model type: GENERIC_SIZES where the config class has the field."""
    from transformers import AutoConfig

    base = AutoConfig.for_model(model_type)
    sizes = {k: v for k, v in (GENERIC_SIZES | ids).items() if hasattr(base, k)}
    return AutoConfig.for_model(model_type, **sizes)


def _biases_matter(model: Any) -> None:
    """Bias vectors initialise to zero; draw them so a model that ignored them would differ."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)


def make_tiny_model(arch: str, path: str | os.PathLike, seed: int | None = None) -> Path:
    """Create (once) the tiny `arch` model + tokenizer folder at `path` (an ARCHITECTURES name, or any
    model type, from generic_config); safe under concurrent callers (built in a temporary sibling
    folder, renamed into place)."""
    import torch
    from tandem.worker.local.toy_model import toy_tokenizer
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = Path(path)
    if (path / MARKER).is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        tokenizer = toy_tokenizer()
        ids = {key: getattr(tokenizer, key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
        config = ARCHITECTURES[arch](**ids) if arch in ARCHITECTURES else generic_config(arch, **ids)
        seed = SEEDS.get(arch, 0) if seed is None else seed
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        _biases_matter(model)
        model.save_pretrained(tmp, safe_serialization=True)
        GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, do_sample=False).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps({"arch": arch, "seed": seed}))
        try:
            os.rename(tmp, path)
        except OSError:
            if not (path / MARKER).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


class LoadedForTests:
    """One tiny model as the tests use it: loaded for the engine on the path `backend` chooses, and
    transformers' own copy for the reference outputs (each prompt's computed once)."""

    def __init__(self, name: str, path: Path, backend: str = "auto"):
        import torch
        from tandem.worker.engine.loader import load_model
        from transformers import AutoModelForCausalLM

        self.name, self.path = name, str(path)
        self.loaded = load_model(self.path, dtype="float32", device="cpu", backend=backend)
        self.hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self._refs: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def reference(self, ids: list[int], max_new_tokens: int) -> list[int]:
        """transformers' greedy generate for `ids` (ignoring EOS): what every path must produce."""
        from tandem.testing.engine_helpers import reference_generate

        key = (tuple(ids), max_new_tokens)
        if key not in self._refs:
            self._refs[key] = reference_generate(self.hf, ids, max_new_tokens)
        return self._refs[key]


def random_prompt(n: int, seed: int) -> list[int]:
    """n token ids: BOS then ids drawn from the tokenizer's learned range with a fixed seed."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(3, VOCAB, (n - 1,), generator=g).tolist()
