"""The compiled decode step (torch.compile at start-up) and the eager path give transformers'
greedy tokens, for batches from 1 to 6 sequences whose contexts span a growing number of
blocks; and after the start-up warm-up no batch shape compiles again (a recompile would fail)."""

from __future__ import annotations

import pytest
from tandem.testing.engine_helpers import greedy, submit, tokens_of
from tandem.worker.engine import paged_forward
from tandem.worker.engine.decode_step import compiler_found

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog", "a", "Kubernetes schedules pods onto nodes",
           "Café, naïve, 東京 🚀", "Numbers like 0 1 2 3"]


@pytest.mark.parametrize("compile", [
    pytest.param("on", marks=pytest.mark.skipif(compiler_found() is None, reason="torch.compile needs g++ or clang++")),
    "off",
])
def test_decode_matches_generate_compiled_and_eager(compile, make_engine, loaded_toy, reference, monkeypatch):
    monkeypatch.setattr(paged_forward, "RECOMPILE_STANCE", "fail_on_recompile")
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
