"""The transformers path's compiled decode step (hf/decode_graph.py): the model's own classes in one
graph, compiled at start-up, give transformers' greedy tokens and float32 logits for decode batches
of 1 to 3 sequences, past the sliding windows (Mistral; Gemma 3's mixed local and global layers),
with routed experts (Qwen3-MoE) and on Llama; no batch shape compiles after the warm-up (a
recompile would fail); every decoder layer of a kind calls one compiled region (the compile costs
a layer, not the model's depth); and compile: off leaves the step eager."""

from __future__ import annotations

import pytest
import torch
from tandem.testing.engine_helpers import greedy, submit, tokens_of
from tandem.testing.tiny_models import WINDOW, LoadedForTests
from tandem.testing.tiny_models import random_prompt as prompt
from tandem.worker.engine import decode_step
from tandem.worker.engine.decode_step import compiler_found

pytestmark = pytest.mark.skipif(compiler_found() is None, reason="torch.compile needs g++ or clang++")
N = 10


@pytest.fixture(scope="module", params=["llama", "mistral", "gemma3", "qwen3_moe"])
def arch(request, tiny_model):
    torch.set_num_threads(1)
    return LoadedForTests(request.param, tiny_model(request.param), backend="transformers")


def engine(arch, compile: str = "on"):
    from tandem.worker.engine.config import EngineConfig
    from tandem.worker.engine.engine import Engine

    return Engine(EngineConfig(model=arch.path, num_blocks=96, block_size=4, max_batched_tokens=64, max_num_seqs=4,
                               prefill_chunk_tokens=7, compile=compile, model_backend="transformers"),
                  loaded=arch.loaded)


def test_compiled_decode_equals_generate(arch, monkeypatch):
    monkeypatch.setattr(decode_step, "RECOMPILE_STANCE", "fail_on_recompile")
    eng = engine(arch)
    assert eng.runner.kernels.decode_step is not None, eng.runner.how
    graph_batches: list[int] = []
    inner = eng.runner.kernels.decode_step
    eng.runner.kernels.decode_step = lambda ids, *a: (graph_batches.append(len(ids)), inner(ids, *a))[1]
    prompts = [prompt(n, seed) for seed, n in enumerate((1, 5, WINDOW + 5, 40))]
    outs = {}
    step = 0
    while step == 0 or eng.has_work():  # one sequence joins per step: decode batches of 1 to 3
        if step < len(prompts):
            outs[step] = submit(eng, f"c{step}", prompts[step], greedy(N))
        eng.step()
        step += 1
    assert {1, 2, 3} <= set(graph_batches), f"decode-only steps of several sizes ran through the graph: {graph_batches}"
    for i, ids in enumerate(prompts):
        assert tokens_of(outs[i]) == arch.reference(ids, N), f"{arch.name} differs on a {len(ids)}-token prompt"
    assert eng.allocator.num_used == 0


def test_compiled_decode_logits_equal_the_models_forward(arch):
    """Token by token through the compiled step, past three windows: at every position the float32
    logits of the model's own forward over the whole sequence."""
    from tandem.worker.engine.model_runner import BatchItem

    eng = engine(arch)
    ids = prompt(3 * WINDOW + 2, 12)
    table = list(range(len(ids) // 4 + 1))
    got = [eng.runner.forward([BatchItem(ids[:9], 0, table, True)]).logits[0]]
    got += [eng.runner.forward([BatchItem([ids[p]], p, table, True)]).logits[0] for p in range(9, len(ids))]
    with torch.no_grad():
        want = arch.hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(torch.stack(got), want[8:], rtol=1e-4, atol=1e-4)


def test_every_decoder_layer_calls_one_compiled_region(arch):
    from tandem.worker.engine.hf.decode_graph import CompiledDecode, decoder_layers

    eng = engine(arch, compile="off")
    assert eng.runner.kernels.decode_step is None and "compile: off" in eng.runner.how
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    graph = CompiledDecode(arch.loaded.model, eng.runner.windows, True)
    graph.decode_step = torch.compile(graph.decode_step._torchdynamo_orig_callable, backend=capture, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        graph.decode_step(torch.tensor([5, 6]), torch.tensor([3, 4]), torch.zeros(2, 2, dtype=torch.long), eng.pool)
    (gm,) = graphs
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and "invoke_subgraph" in str(n.target)]
    windows = eng.runner.windows
    assert len(decoder_layers(arch.loaded.model)) == len(windows) > 1
    # Every layer of the first layer's kind calls the one region; a layer of another kind (Gemma 3's
    # global layer beside its local ones) cannot reuse it and is traced on its own.
    assert len(calls) >= windows.count(windows[0]) and len({n.args[0].target for n in calls}) == 1
