"""Server fixtures: in-process workers (engine thread + aiohttp app on a real loopback port) over
the session's toy model; each is stopped and checked for leaked KV blocks when its test ends."""

from __future__ import annotations

import asyncio
import time
import uuid
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


class Worker:
    def __init__(self, client, state, engine, serve):
        self.client = client
        self.state = state
        self.engine = engine  # the synchronous Engine
        self.transport = None
        self.url = state.settings.advertise_url
        self._serve = serve

    async def serve(self) -> None:
        """Start the engine thread and the transport and mark the worker ready, as a process does
        (worker/server/runtime.py start_serving)."""
        await self._serve()
        self.transport = self.state.transport

    @property
    def auth(self) -> dict[str, str]:
        """The header that proves membership of the worker's service ({} when it has no secret)."""
        from tandem.contracts.internal_auth import auth_headers

        return auth_headers(self.state.settings.internal_secret)

    async def wait_idle(self, within: float = 10.0) -> None:
        """Until nothing holds a block here (aborts and lease expiry finish asynchronously)."""
        deadline = time.monotonic() + within
        while self.engine.allocator.num_used or self.engine.seqs or self.engine.leases:
            if time.monotonic() > deadline:
                raise AssertionError(f"still {self.engine.allocator.num_used} blocks used, "
                                     f"seqs={list(self.engine.seqs)}, leases={list(self.engine.leases)}")
            await asyncio.sleep(0.02)


@pytest.fixture
async def start_worker(server_loaded_toy, toy_model_dir):
    from aiohttp.test_utils import TestClient, TestServer
    from tandem.contracts.names import Role
    from tandem.worker.engine.config import EngineConfig
    from tandem.worker.engine.engine import Engine
    from tandem.worker.kv.base import KVTransferConfig
    from tandem.worker.server.app import WorkerSettings, WorkerState, create_app
    from tandem.worker.server.runtime import start_serving

    started: list[Worker] = []

    async def start(role: str = "colocated", kv_backend: str | None = None, lease_s: float = 30.0,
                    attach: bool = True, secret: str | None = None, stall_s: float = 120.0,
                    serve_kv: bool | None = None, generation: str = "g1", **overrides) -> Worker:
        cfg = dict(model=str(toy_model_dir), num_blocks=128, block_size=8, max_num_seqs=8,
                   max_batched_tokens=256)
        cfg.update(overrides)
        engine_id = f"test-{role}-{uuid.uuid4().hex[:8]}"
        state = WorkerState(WorkerSettings(role=Role(role), advertise_url="", engine_id=engine_id,
                                           generation=generation, reserve_wait_s=2.0, internal_secret=secret))
        eng = Engine(EngineConfig(**cfg), loaded=server_loaded_toy, lease_s=lease_s,
                     on_step=state.metrics.observe_step)
        client = TestClient(TestServer(create_app(state)))
        await client.start_server()
        state.settings.advertise_url = str(client.make_url("")).rstrip("/")
        kv_config = KVTransferConfig(backend=kv_backend or "none", timeout_s=5.0, lease_s=lease_s,
                                     extra={"kv_metrics": state.metrics.kv_transfer},
                                     secret=secret, serve=role != "decode" if serve_kv is None else serve_kv)
        w = Worker(client, state, eng, lambda: start_serving(state, eng, stall_s=stall_s,
                                                             kv_backend=kv_backend or "none", kv_config=kv_config))
        started.append(w)
        if attach:
            await w.serve()
        return w

    yield start
    errors = []
    for w in started:
        try:
            await w.wait_idle()
        except AssertionError as e:
            errors.append(str(e))
        await w.client.close()
        if w.state.engine is not None:
            await w.state.engine.stop()
        if w.state.transport is not None:
            await w.state.transport.close()
    assert not errors, errors
