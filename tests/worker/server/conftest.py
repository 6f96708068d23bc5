"""Server fixtures: in-process workers (engine thread + aiohttp app on a real loopback port) over
the session's toy model; each is stopped and checked for leaked KV blocks when its test ends."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def server_loaded_toy(toy_model_dir: Path):
    from tandem.worker.engine.loader import load_model

    torch.set_num_threads(1)
    return load_model(str(toy_model_dir), dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def server_hf_toy(toy_model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(toy_model_dir, dtype=torch.float32).eval()


@pytest.fixture
async def start_worker(server_loaded_toy, toy_model_dir):
    from tandem.testing.inprocess_worker import InProcessWorkers

    workers = InProcessWorkers(server_loaded_toy, str(toy_model_dir))
    yield workers.start
    errors = await workers.close()
    assert not errors, errors
