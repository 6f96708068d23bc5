"""Engine fixtures: the toy model loaded once, engines built over it, and transformers' own generate
as the reference. Every engine is checked for leaked KV blocks when its test ends."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def loaded_toy(toy_model_dir: Path):
    from tandem.worker.engine.loader import load_model

    torch.set_num_threads(1)
    return load_model(str(toy_model_dir), dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def hf_toy(toy_model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(toy_model_dir, dtype=torch.float32).eval()


@pytest.fixture
def make_engine(loaded_toy, toy_model_dir: Path) -> Iterator[Callable[..., object]]:
    """Engine(**overrides) over the session's toy model; asserts no block is left in use afterwards."""
    from tandem.worker.engine.config import EngineConfig
    from tandem.worker.engine.engine import Engine

    made = []

    def make(**overrides):
        cfg = dict(model=str(toy_model_dir), num_blocks=256, block_size=16, max_num_seqs=16,
                   max_batched_tokens=512)
        cfg.update(overrides)
        lease_s = cfg.pop("lease_s", 30.0)
        eng = Engine(EngineConfig(**cfg), loaded=loaded_toy, lease_s=lease_s)
        made.append(eng)
        return eng

    yield make
    for eng in made:
        assert not eng.seqs and not eng.leases, "sequences or leases left behind"
        assert eng.allocator.num_used == 0, f"{eng.allocator.num_used} KV blocks leaked"


@pytest.fixture
def reference(hf_toy, loaded_toy) -> Callable[..., list[int]]:
    """transformers' greedy generate for one prompt, alone (no padding): the ground truth."""
    from tandem.testing.engine_helpers import reference_generate

    def generate(prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool = True) -> list[int]:
        return reference_generate(hf_toy, prompt_ids, max_new_tokens,
                                  pad_token_id=loaded_toy.tokenizer.pad_token_id, ignore_eos=ignore_eos)

    return generate
