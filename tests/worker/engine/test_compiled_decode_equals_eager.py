"""The compiled decode step (torch.compile at start-up) and the eager path give transformers'
greedy tokens, for batches from 1 to 6 sequences whose contexts span a growing number of blocks;
after the start-up warm-up no batch shape compiles again (a recompile would fail), also with a
second graph for contexts past 4096 tokens. (One compiled region per layer kind, and the other
architectures: test_transformers_path_compiles_its_decode_step.py.)"""

from __future__ import annotations

import pytest
import torch
from tandem.testing.engine_helpers import greedy, submit, tokens_of
from tandem.worker.engine import decode_step
from tandem.worker.engine.decode_step import compiler_found

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog", "a", "Kubernetes schedules pods onto nodes",
           "Café, naïve, 東京 🚀", "Numbers like 0 1 2 3"]


@pytest.mark.parametrize("compile", [
    pytest.param("on", marks=pytest.mark.skipif(compiler_found() is None, reason="torch.compile needs g++ or clang++")),
    "off",
])
def test_decode_matches_generate_compiled_and_eager(compile, make_engine, loaded_toy, reference, monkeypatch):
    monkeypatch.setattr(decode_step, "RECOMPILE_STANCE", "fail_on_recompile")
    eng = make_engine(block_size=4, compile=compile)
    assert (eng.runner.kernels.decode_step is not None) == (compile == "on")
    tok = loaded_toy.tokenizer
    prompt_ids = [tok(p)["input_ids"] for p in PROMPTS]
    lengths = [40, 9, 33, 17, 25, 12]
    outs: dict[int, list] = {}
    decode_batches: set[int] = set()
    eng.on_step = lambda seconds, n: decode_batches.add(n) if len(eng.scheduler.running) == n else None
    step = 0
    while step == 0 or eng.has_work() or len(outs) < len(PROMPTS):
        if step < len(PROMPTS):  # one sequence joins per step: batches of 1..6
            outs[step] = submit(eng, f"r{step}", prompt_ids[step], greedy(lengths[step]))
        eng.step()
        step += 1
    assert {1, 2, 6} <= decode_batches, "decode-only steps at several batch sizes were meant to run"
    for i, ids in enumerate(prompt_ids):
        assert tokens_of(outs[i]) == reference(ids, lengths[i]), f"sequence {i} diverged ({compile})"


@pytest.mark.skipif(compiler_found() is None, reason="torch.compile needs g++ or clang++")
def test_contexts_past_4096_tokens_have_their_own_graph(tmp_path_factory, monkeypatch):
    """Inductor sums more than 4096 floats differently, so a graph traced for short contexts does
    not serve a 4100-token one; the warm-up compiles both when the context length allows it."""
    from tandem.testing.engine_helpers import reference_generate, run_to_completion
    from tandem.worker.engine.config import EngineConfig
    from tandem.worker.engine.engine import Engine
    from tandem.worker.local.toy_model import make_toy_model
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(decode_step, "RECOMPILE_STANCE", "fail_on_recompile")
    path = make_toy_model(tmp_path_factory.getbasetemp() / "toy-llama-8k", max_position_embeddings=8192)
    eng = Engine(EngineConfig(model=str(path), dtype="float32", num_blocks=300, block_size=16, max_num_seqs=2,
                              max_batched_tokens=4200, compile="on"))
    assert len(eng.runner.kernels.traced) == 2
    long_ids = [3 + (i * 7919) % 500 for i in range(4100)]
    outs = [submit(eng, "long", long_ids, greedy(6)), submit(eng, "short", [1, 5, 9], greedy(6))]
    run_to_completion(eng)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert tokens_of(outs[0]) == reference_generate(hf, long_ids, 6)
    assert tokens_of(outs[1]) == reference_generate(hf, [1, 5, 9], 6)
