"""Every architecture of testing/tiny_models.py (llama, mistral, qwen2, qwen3, gemma3, phi3,
mixtral, qwen3_moe) runs through the engine (transformers' own classes, its paged attention) and gives greedy outputs
equal to transformers' generate in float32, token for token: prompts batched together and
prefilled in chunks that split them across steps (decode tokens and prompt chunks in one step),
longer than the sliding windows, and again from prefix-cache hits; and the step's float32 logits
equal the model's own forward at every position. Every other model type the
transformers path lists runs the same checks on a generic tiny model (testing/tiny_models.py)."""

from __future__ import annotations

import pytest
import torch
from tandem.contracts.model_support import TRANSFORMERS_MODEL_TYPES, ModelBackend
from tandem.testing.engine_helpers import greedy, run_to_completion, submit, tokens_of
from tandem.testing.tiny_models import ARCHITECTURES, WINDOW, LoadedForTests
from tandem.testing.tiny_models import random_prompt as prompt

N = 10


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def arch(request, tiny_model):
    torch.set_num_threads(1)
    return LoadedForTests(request.param, tiny_model(request.param))


def engine(arch, **kw):
    from tandem.worker.engine.config import EngineConfig
    from tandem.worker.engine.engine import Engine

    cfg = dict(model=arch.path, num_blocks=96, block_size=4, max_batched_tokens=64, max_num_seqs=4,
               prefill_chunk_tokens=7, compile="off") | kw
    return Engine(EngineConfig(**cfg), loaded=arch.loaded)


def run(eng, prompts: list[list[int]], tag: str) -> list[list[int]]:
    outs = [submit(eng, f"{tag}{i}", ids, greedy(N)) for i, ids in enumerate(prompts)]
    run_to_completion(eng)
    assert eng.allocator.num_used == 0
    return [tokens_of(o) for o in outs]


def test_batched_chunked_prompts_equal_generate(arch):
    assert arch.loaded.backend is ModelBackend.TRANSFORMERS
    prompts = [prompt(n, seed) for seed, n in enumerate((1, 5, WINDOW + 5, 40))]
    got = run(engine(arch), prompts, "b")
    for ids, toks in zip(prompts, got, strict=True):
        assert toks == arch.reference(ids, N), f"{arch.name} differs on a {len(ids)}-token prompt"


def test_prefix_cache_hits_equal_generate(arch):
    eng = engine(arch)
    first = prompt(26, 7)
    again = [first, first[:16] + prompt(9, 8)[1:], first + prompt(6, 9)[1:]]
    assert run(eng, [first], "p") == [arch.reference(first, N)]
    hits = eng.prefix_cache.stats.hit_tokens_total
    for ids, toks in zip(again, run(eng, again, "q"), strict=True):
        assert toks == arch.reference(ids, N), f"{arch.name} differs after a prefix-cache hit ({len(ids)} tokens)"
    # 24, 16 and 24 tokens of the first prompt's full blocks came from the cache.
    assert eng.prefix_cache.stats.hit_tokens_total - hits >= 16 + 16


def check_logits(arch) -> None:
    """A prompt prefilled in two chunks then decoded token by token through the runner gives, at
    every position, the float32 logits of the model's own forward over the whole sequence."""
    from tandem.worker.engine.model_runner import BatchItem

    eng = engine(arch)
    ids = prompt(3 * WINDOW + 2, 12)
    table = list(range(len(ids) // 4 + 1))
    got = [eng.runner.forward([BatchItem(ids[:9], 0, table, True)]).logits[0],
           eng.runner.forward([BatchItem(ids[9:20], 9, table, True)]).logits[0]]
    got += [eng.runner.forward([BatchItem([ids[p]], p, table, True)]).logits[0] for p in range(20, len(ids))]
    with torch.no_grad():
        want = arch.hf(torch.tensor([ids])).logits[0].float()
    positions = [8] + list(range(19, len(ids)))
    torch.testing.assert_close(torch.stack(got), want[positions], rtol=1e-4, atol=1e-4)


def test_step_logits_equal_the_models_own_forward(arch):
    """Logits, not only their argmax: what greedy tokens cannot show, like final soft-capping."""
    check_logits(arch)


# Every other type on the transformers path (contracts/model_support.py), on a generic tiny model.
OTHER_TYPES = sorted(TRANSFORMERS_MODEL_TYPES - set(ARCHITECTURES) - {"gemma3_text"})


@pytest.mark.parametrize("model_type", OTHER_TYPES)
def test_every_other_listed_type_equals_generate(model_type, tiny_model):
    arch = LoadedForTests(model_type, tiny_model(model_type))
    assert arch.loaded.backend is ModelBackend.TRANSFORMERS
    prompts = [prompt(n, seed) for seed, n in enumerate((5, WINDOW + 5, 30))]
    for ids, toks in zip(prompts, run(engine(arch), prompts, "g"), strict=True):
        assert toks == arch.reference(ids, N), f"{model_type} differs on a {len(ids)}-token prompt"
    check_logits(arch)
