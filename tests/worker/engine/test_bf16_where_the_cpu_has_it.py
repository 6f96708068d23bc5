"""dtype auto: a bf16 or fp16 checkpoint runs in bf16 on a CPU with native bf16 (AVX512-BF16 or
AMX), else fp32; an fp32 checkpoint stays fp32 (exact). The bf16 engine, compiled and eager,
picks the same first token as transformers in fp32 (the toy's logits are far apart)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tandem.testing.engine_helpers import greedy, run_to_completion, submit, tokens_of
from tandem.worker.engine import loader
from tandem.worker.engine.decode_step import compiler_found

CPU, GPU = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize(("saved", "features", "expected"), [
    ("bfloat16", ["avx512_bf16"], torch.bfloat16),
    ("float16", ["amx_bf16"], torch.bfloat16),
    ("bfloat16", [], torch.float32),
    ("float32", ["avx512_bf16"], torch.float32),
    (None, ["avx512_bf16"], torch.float32),
])
def test_auto_on_cpu(saved, features, expected, monkeypatch):
    monkeypatch.setattr(loader, "cpu_bf16_features", lambda: features)
    dtype, why = loader.resolve_dtype("auto", SimpleNamespace(dtype=saved), CPU)
    assert dtype == expected and why.startswith("auto")


def test_auto_on_gpu_and_explicit_choices():
    assert loader.resolve_dtype("auto", SimpleNamespace(dtype="float16"), GPU)[0] == torch.float16
    assert loader.resolve_dtype("auto", SimpleNamespace(dtype=None), GPU)[0] == torch.bfloat16
    assert loader.resolve_dtype("bfloat16", SimpleNamespace(dtype="float32"), CPU) == (torch.bfloat16, "asked for")
    with pytest.raises(loader.ModelLoadError, match="int4"):
        loader.resolve_dtype("int4", SimpleNamespace(dtype=None), CPU)


@pytest.mark.parametrize("compile", [
    pytest.param("on", marks=pytest.mark.skipif(compiler_found() is None, reason="torch.compile needs g++ or clang++")),
    "off",
])
def test_bf16_engine_agrees_with_fp32_on_the_first_token(compile, toy_model_dir, loaded_toy, reference):
    from tandem.worker.engine.config import EngineConfig
    from tandem.worker.engine.engine import Engine

    eng = Engine(EngineConfig(model=str(toy_model_dir), dtype="bfloat16", num_blocks=64, block_size=4,
                              max_num_seqs=4, max_batched_tokens=256, compile=compile))
    assert eng.pool.dtype == torch.bfloat16
    prompts = [loaded_toy.tokenizer(p)["input_ids"] for p in ("Hello, world!", "a", "Kubernetes schedules pods")]
    outs = [submit(eng, f"b{i}", ids, greedy(8)) for i, ids in enumerate(prompts)]
    run_to_completion(eng)
    for ids, out in zip(prompts, outs, strict=True):
        got = tokens_of(out)
        assert len(got) == 8 and got[0] == reference(ids, 1)[0]
    assert eng.allocator.num_used == 0
