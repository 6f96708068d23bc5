"""Bad input gets a clear error and the engine keeps serving: prompts over the context, max_tokens
below 1, malformed requests, an unknown model folder, an architecture the engine does not run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from tandem.contracts.protocol import GenerateRequest
from tandem.contracts.sampling import SamplingParams
from tandem.testing.engine_helpers import greedy, run_to_completion, submit, tokens_of
from tandem.worker.engine.errors import ModelLoadError, RequestError
from tandem.worker.engine.loader import load_model


def _still_serves(eng, loaded_toy, reference):
    ids = loaded_toy.tokenizer("Hello, world!")["input_ids"]
    outs = submit(eng, "after", ids, greedy(5))
    run_to_completion(eng)
    assert tokens_of(outs) == reference(ids, 5)


def test_prompt_longer_than_context(make_engine, loaded_toy, reference):
    eng = make_engine(max_model_len=16)
    long_ids = loaded_toy.tokenizer("The quick brown fox jumps over the lazy dog " * 3)["input_ids"]
    assert len(long_ids) >= 16
    with pytest.raises(RequestError) as e:
        eng.make_sequence(GenerateRequest(request_id="x", prompt_token_ids=long_ids))
    assert e.value.code == "context_length_exceeded" and e.value.status == 400
    assert "maximum context length is 16 tokens" in str(e.value)
    _still_serves(eng, loaded_toy, reference)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"sampling": SamplingParams(max_tokens=0)}, "max_tokens"),
        ({"sampling": SamplingParams(max_tokens=-3)}, "max_tokens"),
        ({"sampling": SamplingParams(temperature=-1)}, "temperature"),
        ({"sampling": SamplingParams(top_p=0)}, "top_p"),
        ({"prompt_token_ids": [1, 2, 100000]}, "prompt"),
        ({"prompt_token_ids": [5], "prompt": "both"}, "prompt"),
        ({"prompt_token_ids": None}, "prompt"),
        ({"messages": "not a list", "prompt_token_ids": None}, "messages"),
        ({"generated_token_ids": [5, 6, 7], "sampling": SamplingParams(max_tokens=3)}, "max_tokens"),
    ],
)
def test_invalid_requests(make_engine, loaded_toy, reference, fields, param):
    eng = make_engine()
    req = GenerateRequest(request_id="bad", prompt_token_ids=[0, 5, 6])
    for k, v in fields.items():
        setattr(req, k, v)
    with pytest.raises(RequestError) as e:
        eng.make_sequence(req)
    assert e.value.status == 400 and e.value.param == param
    _still_serves(eng, loaded_toy, reference)


def test_duplicate_request_id_is_refused(make_engine, loaded_toy):
    eng = make_engine()
    outs = submit(eng, "dup", [0, 5, 6], greedy(3))
    with pytest.raises(RequestError) as e:
        submit(eng, "dup", [0, 7], greedy(3))
    assert e.value.status == 409
    run_to_completion(eng)
    assert len(tokens_of(outs)) == 3


def test_unknown_model_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="no Hugging Face model at"):
        load_model(str(tmp_path / "nope"))


def _save_with_toy_tokenizer(model, toy_model_dir: Path, dest: Path) -> str:
    model.save_pretrained(dest)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (toy_model_dir / f).exists():
            shutil.copy(toy_model_dir / f, dest / f)
    return str(dest)


def test_an_architecture_neither_path_verified_is_refused(tmp_path, toy_model_dir):
    from transformers import BloomConfig, BloomForCausalLM

    path = _save_with_toy_tokenizer(
        BloomForCausalLM(BloomConfig(n_layer=1, hidden_size=32, n_head=2, vocab_size=512)),
        toy_model_dir, tmp_path / "bloom")
    with pytest.raises(ModelLoadError, match="model_type 'bloom' is not supported"):
        load_model(path)


def test_unsupported_architecture_is_refused_before_the_weights_load(tmp_path):
    """The refusal comes from config.json alone (the words the operator uses): a folder with no
    weights at all gets it, rather than a load error."""
    import json

    from tandem.contracts.model_support import check_model_config

    config = {"model_type": "deepseek_v3", "num_attention_heads": 8, "kv_lora_rank": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as e:
        load_model(str(tmp_path))
    assert str(e.value) == check_model_config(config)
    assert "multi-head latent attention" in str(e.value)
