"""check_model_config judges a model from its config.json alone (the operator calls it before any
download, the worker before loading weights): supported architectures pass, latent-attention and
recurrent models, multimodal, encoder-decoder and quantized checkpoints are refused with a reason,
and a tensor-parallel size that does not split heads, KV heads or experts evenly is refused."""

from __future__ import annotations

import pytest
from tandem.contracts.model_support import (
    TRANSFORMERS_MODEL_TYPES,
    ModelBackend,
    check_model_config,
    serving_backend,
)


def cfg(model_type: str = "llama", **kw) -> dict:
    return {"model_type": model_type, "num_attention_heads": 32, "num_key_value_heads": 8,
            "hidden_size": 4096, **kw}


@pytest.mark.parametrize("model_type", sorted(TRANSFORMERS_MODEL_TYPES))
def test_every_listed_architecture_passes(model_type):
    assert check_model_config(cfg(model_type)) is None


def test_auto_takes_the_transformers_path_for_every_architecture():
    for config in (cfg("llama"), cfg("qwen3"), cfg("mistral", sliding_window=None),
                   cfg("qwen2", sliding_window=4096, use_sliding_window=False)):
        assert serving_backend(config)[0] is ModelBackend.TRANSFORMERS
    assert check_model_config(cfg("gemma3_text", rope_parameters={"full_attention": {"rope_type": "linear"},
                                                                  "sliding_attention": {"rope_type": "default"}})) is None
    assert serving_backend(cfg("llama"), "transformers")[0] is ModelBackend.TRANSFORMERS


@pytest.mark.parametrize(("config", "words"), [
    (cfg("deepseek_v3", kv_lora_rank=512), "multi-head latent attention"),
    (cfg("qwen3_next"), "recurrent or linear-attention state"),
    (cfg("mamba"), "recurrent"),
    (cfg("gemma3", vision_config={}, text_config={}), "multimodal"),
    (cfg("t5", is_encoder_decoder=True), "encoder-decoder"),
    (cfg("llama", quantization_config={"quant_method": "awq"}), "quantized checkpoints (awq)"),
    (cfg("made_up_lm"), "model_type 'made_up_lm' is not supported"),
    (cfg("phi3", rope_scaling={"type": "longrope", "short_factor": [1.0], "long_factor": [4.0]}),
     "rope_type 'longrope' is not supported"),
    (cfg("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "longest position in each forward"),
    ({"architectures": ["X"]}, "names no model_type"),
])
def test_unservable_models_are_refused_with_a_reason(config, words):
    reason = check_model_config(config)
    assert reason is not None and words in reason, reason


def test_a_backend_that_does_not_exist_is_refused():
    assert "the native path is gone" in check_model_config(cfg("llama"), backend="native")
    assert "must be auto or transformers" in check_model_config(cfg(), backend="vllm")
    assert check_model_config(cfg("llama"), backend="transformers") is None


@pytest.mark.parametrize(("config", "tp", "words"), [
    (cfg(num_attention_heads=12, num_key_value_heads=4), 8, "does not divide the model's 12 attention heads"),
    (cfg(num_attention_heads=24, num_key_value_heads=6), 4, "cannot share the model's 6 KV heads"),
    (cfg(), 0, "whole number >= 1"),
    (cfg("phi3"), 2, "on the transformers path only"),
    (cfg("mixtral", num_local_experts=6), 4, "does not divide the model's 6 experts"),
])
def test_a_tensor_parallel_size_that_does_not_fit_is_refused(config, tp, words):
    reason = check_model_config(config, tensor_parallel=tp)
    assert reason is not None and words in reason, reason


def test_tensor_parallel_sizes_that_split_evenly_pass():
    assert check_model_config(cfg(), tensor_parallel=8) is None  # 32 heads, 8 KV heads
    assert check_model_config(cfg(num_key_value_heads=2), tensor_parallel=4) is None  # KV heads replicated
    assert check_model_config(cfg(num_key_value_heads=None), tensor_parallel=4) is None  # MHA
    assert check_model_config(cfg("qwen3_moe", num_experts=128), tensor_parallel=8) is None  # 16 experts a rank
