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
    def __init__(self, client, state, engine, transport=None):
        self.client = client
        self.state = state
        self.engine = engine  # the synchronous Engine
        self.transport = transport
        self.url = state.settings.advertise_url

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
    from tandem.worker.engine.async_engine import AsyncEngine
    from tandem.worker.engine.config import EngineConfig
    from tandem.worker.engine.engine import Engine
    from tandem.worker.server.app import WorkerSettings, WorkerState, attach_engine, create_app

    started: list[tuple[Worker, AsyncEngine, object]] = []

    async def start(role: str = "colocated", kv_backend: str | None = None, lease_s: float = 30.0,
                    attach: bool = True, secret: str | None = None, stall_s: float = 120.0,
                    serve_kv: bool | None = None, **overrides) -> Worker:
        cfg = dict(model=str(toy_model_dir), num_blocks=128, block_size=8, max_num_seqs=8,
                   max_batched_tokens=256)
        cfg.update(overrides)
        eng = Engine(EngineConfig(**cfg), loaded=server_loaded_toy, lease_s=lease_s)
        engine_id = f"test-{role}-{uuid.uuid4().hex[:8]}"
        state = WorkerState(WorkerSettings(role=Role(role), advertise_url="", engine_id=engine_id,
                                           generation="g1", reserve_wait_s=2.0, internal_secret=secret))
        client = TestClient(TestServer(create_app(state)))
        await client.start_server()
        state.settings.advertise_url = str(client.make_url("")).rstrip("/")
        aeng = AsyncEngine(eng, stall_s=stall_s)
        transport = None
        if kv_backend is not None:
            from tandem.worker.kv.base import KVTransferConfig
            from tandem.worker.kv.registry import create_transport

            transport = create_transport(kv_backend, eng.pool, eng.layout, engine_id,
                                         KVTransferConfig(backend=kv_backend, timeout_s=5.0, lease_s=lease_s,
                                                          extra={"prometheus_registry": state.metrics.registry},
                                                          secret=secret,
                                                          serve=role != "decode" if serve_kv is None else serve_kv))
            await transport.start()
        w = Worker(client, state, eng, transport)
        started.append((w, aeng, transport))
        if attach:
            aeng.start()
            attach_engine(state, aeng, transport)
        return w

    yield start
    errors = []
    for w, aeng, transport in started:
        try:
            await w.wait_idle()
        except AssertionError as e:
            errors.append(str(e))
        await w.client.close()
        if aeng._thread is not None:
            await aeng.stop()
        if transport is not None:
            await transport.close()
    assert not errors, errors
