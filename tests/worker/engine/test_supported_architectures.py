"""Beyond Llama: Qwen2 (biases on q/k/v) and Mistral (its own module classes, GQA, explicit
head_dim) run through the engine's forward pass and match transformers' generate."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from tandem.testing.engine_helpers import greedy, run_to_completion, submit, tokens_of


def _save_with_toy_tokenizer(model, toy_model_dir: Path, dest: Path) -> str:
    model.save_pretrained(dest)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (toy_model_dir / f).exists():
            shutil.copy(toy_model_dir / f, dest / f)
    return str(dest)


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=0.15, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # make the biases matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=None,
                        max_position_embeddings=512, initializer_range=0.15)
    return MistralForCausalLM(cfg)


@pytest.mark.parametrize("build", [_qwen2, _mistral], ids=["qwen2", "mistral"])
def test_architecture_matches_generate(build, tmp_path, toy_model_dir):
    from tandem.worker.engine.config import EngineConfig
    from tandem.worker.engine.engine import Engine

    torch.manual_seed(0)
    model = build().eval()
    path = _save_with_toy_tokenizer(model, toy_model_dir, tmp_path / "model")
    eng = Engine(EngineConfig(model=path, num_blocks=32, block_size=8, max_batched_tokens=64, max_num_seqs=4))
    ids = eng.tokenizer("The quick brown fox jumps over the lazy dog")["input_ids"]
    outs = submit(eng, "q", ids, greedy(12))
    run_to_completion(eng)
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                             min_new_tokens=12)[0, len(ids):].tolist()
    assert tokens_of(outs) == ref
    assert eng.allocator.num_used == 0
