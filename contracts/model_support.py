"""Which models a Tandem worker serves, and on which path, judged from config.json alone.

The operator calls `check_model_config` on a model's config.json before any pod downloads weights,
and the worker calls it at start before loading them: both refuse with the same words. Pure (the
operator never imports torch or transformers), so the lists below are what the tests verified:
each model type on the transformers path runs in tests/worker/engine/test_architectures_*.py
against transformers' own generate.
"""

from __future__ import annotations

import enum
from typing import Any

from tandem.contracts.parallelism import tensor_parallel_problem_for


class ModelBackend(enum.StrEnum):
    """The forward pass a worker runs: transformers' own model classes with Tandem's paged
    attention plugged in, for every verified type (auto names the same; the hand-written Llama pass
    it replaced is gone)."""

    AUTO = "auto"
    TRANSFORMERS = "transformers"


# Decoder-only causal LMs whose transformers definitions run on Tandem's paged KV cache, each one
# checked token for token against transformers' generate, and logit for logit against its forward:
# the first eight in depth (tests/worker/engine/test_architectures_match_generate.py, and with KV
# handoff, prefix caching and migration in tests/worker/kv/test_architectures_hand_off_kv.py), the
# rest on a tiny model each in the first file.
TRANSFORMERS_MODEL_TYPES = frozenset({
    "llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3", "qwen3_moe", "mixtral",
    "afmoe", "apertus", "arcee", "aria_text", "beam", "bitnet", "cohere", "cohere2", "cohere2_moe", "cwm",
    "ernie4_5", "ernie4_5_moe", "exaone4", "exaone_moe", "flex_olmo", "flint", "gemma", "gemma2", "glm", "glm4",
    "glm4_moe", "gpt2", "gpt_neox", "gpt_oss", "granite", "granite_swa", "granitemoe", "granitemoe_swa",
    "granitemoeshared", "helium", "hunyuan_v1_dense", "hunyuan_v1_moe", "hy_v3", "hyperclovax", "internlm3",
    "iquestcoder", "jais2", "kolibri1", "laguna", "mellum", "minimax_m2", "minimax_m3_vl_text", "ministral",
    "ministral3", "nanochat", "olmo", "olmo2", "olmo3", "olmoe", "opt", "persimmon", "phi", "phimoe",
    "qwen2_moe", "seed_oss", "smollm3", "solar_open", "starcoder2", "vaultgemma",
})

_LATENT = ("uses multi-head latent attention (MLA): its KV cache holds one compressed latent per token "
           "(kv_lora_rank + qk_rope_head_dim values, shared by all heads), not a K and a V per KV head, "
           "which is the only layout Tandem's paged KV pool and its handoff carry")
_RECURRENT = ("keeps a recurrent or linear-attention state besides (or instead of) a KV cache; Tandem's "
              "paged pool, prefix cache and handoff carry only per-token K and V")
REFUSED_MODEL_TYPES: dict[str, str] = {
    **dict.fromkeys(("deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4", "kimi_k2", "minicpm3",
                     "longcat_flash", "glm4_moe_lite", "glm_moe_dsa"), _LATENT),
    **dict.fromkeys(("mamba", "mamba2", "falcon_mamba", "falcon_h1", "jamba", "bamba", "zamba", "zamba2",
                     "nemotron_h", "granitemoehybrid", "qwen3_next", "qwen3_5", "qwen3_5_text",
                     "qwen3_5_moe", "qwen3_5_moe_text", "lfm2", "lfm2_moe", "recurrent_gemma", "rwkv",
                     "xlstm", "minimax", "kimi_linear", "olmo_hybrid", "bailing_hybrid"), _RECURRENT),
}

# Where a config.json names its routed experts' count (Mixtral, Qwen-MoE, DeepSeek/GLM style).
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")

# Split across a tensor-parallel group on the transformers path (attention heads and dense MLPs by
# the model's own plan, routed experts whole per rank: worker/engine/hf/tensor_parallel.py),
# verified at tensor_parallel 2 (tests/worker/engine/test_transformers_path_splits_across_ranks.py).
# Other types on that path run on one rank.
TRANSFORMERS_TENSOR_PARALLEL_TYPES = frozenset({
    "llama", "mistral", "qwen2", "qwen3", "gemma3_text", "mixtral", "qwen3_moe",
})


# Rotary variants whose frequencies transformers recomputes from the longest position in the
# forward call: in a step that batches many sequences (or prefills a prompt in chunks) that is not
# each sequence's own length, so no batched engine reproduces generate for them.
LENGTH_DEPENDENT_ROPE_TYPES = frozenset({"dynamic", "longrope"})


def rope_types(config_json: dict[str, Any]) -> set[str]:
    """The rotary variants a config asks for, one per layer kind where it has several (Gemma 3's
    rope_parameters are keyed by layer type); {'default'} when it names none."""
    rope = config_json.get("rope_parameters") or config_json.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        return {"default"}
    parts = [v for v in rope.values() if isinstance(v, dict)] or [rope]
    return {str(p.get("rope_type", p.get("type", "default"))) for p in parts}


def serving_backend(config_json: dict[str, Any], requested: str = "auto") -> tuple[ModelBackend, str]:
    """The path a worker runs this model on, and why: the transformers path, one for every
    architecture (raises ValueError for a backend that does not exist)."""
    ModelBackend(requested)
    return ModelBackend.TRANSFORMERS, "the model's own classes"


def expert_count(config_json: dict[str, Any]) -> int | None:
    for key in EXPERT_COUNT_KEYS:
        if isinstance(config_json.get(key), int) and config_json[key] > 0:
            return int(config_json[key])
    return None


def _architecture_reason(config_json: dict[str, Any]) -> str | None:
    model_type = config_json.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        return "config.json names no model_type: not a Hugging Face transformers model folder"
    if model_type in REFUSED_MODEL_TYPES:
        return f"model_type {model_type!r} is not supported: it {REFUSED_MODEL_TYPES[model_type]}"
    if "vision_config" in config_json or "audio_config" in config_json:
        return (f"model_type {model_type!r} is multimodal (it has a vision or audio tower); Tandem serves "
                "text-only decoder models")
    if config_json.get("is_encoder_decoder"):
        return f"model_type {model_type!r} is an encoder-decoder model; Tandem serves decoder-only causal LMs"
    if config_json.get("quantization_config"):
        method = (config_json["quantization_config"] or {}).get("quant_method", "unnamed")
        return f"quantized checkpoints ({method}) are not supported: serve a float32, float16 or bfloat16 one"
    if dependent := sorted(rope_types(config_json) & LENGTH_DEPENDENT_ROPE_TYPES):
        return (f"rope_type {dependent[0]!r} is not supported: transformers recomputes its rotary frequencies "
                "from the longest position in each forward call, which in a batch of many sequences (or a "
                "prompt prefilled in chunks) is not each sequence's own length, so outputs would differ")
    if model_type not in TRANSFORMERS_MODEL_TYPES:
        return (f"model_type {model_type!r} is not supported: Tandem serves the decoder-only causal LMs it "
                f"has verified ({', '.join(sorted(TRANSFORMERS_MODEL_TYPES))})")
    return None


def _parallel_reason(config_json: dict[str, Any], tensor_parallel: int) -> str | None:
    if not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        return f"tensor_parallel must be a whole number >= 1, got {tensor_parallel!r}"
    tp = tensor_parallel
    if tp == 1:
        return None
    model_type = config_json.get("model_type")
    if model_type not in TRANSFORMERS_TENSOR_PARALLEL_TYPES:
        return (f"tensor_parallel {tp} is not available for {model_type!r}: on the transformers path only "
                f"{', '.join(sorted(TRANSFORMERS_TENSOR_PARALLEL_TYPES))} split across ranks; it runs on one")
    heads = config_json.get("num_attention_heads")
    kv_heads = config_json.get("num_key_value_heads") or heads
    if not isinstance(heads, int) or not isinstance(kv_heads, int):
        return "config.json names no num_attention_heads: cannot split the model across ranks"
    if (problem := tensor_parallel_problem_for(heads, kv_heads, tp)) is not None:
        return problem
    experts = expert_count(config_json)
    if experts is not None and experts % tp:
        return f"tensor_parallel {tp} does not divide the model's {experts} experts (each rank holds whole experts)"
    return None


def check_model_config(config_json: dict[str, Any], tensor_parallel: int = 1,
                       backend: str = "auto") -> str | None:
    """None when a worker can serve this model at this tensor-parallel size (on `backend`: auto or
    transformers); else the reason, in words a person acts on."""
    if not isinstance(config_json, dict):
        return "config.json is not a JSON object"
    if (reason := _architecture_reason(config_json)) is not None:
        return reason
    try:
        serving_backend(config_json, backend)
    except ValueError:
        return (f"model backend must be auto or transformers, got {backend!r} (the native path is gone: "
                "transformers' own classes run every model)")
    return _parallel_reason(config_json, tensor_parallel)
