"""Workers inside the test process: a real engine thread, the worker's aiohttp app on a loopback
port and, when asked, a real KV transport (tcp, nixl or memory), started as a worker process starts
them (worker/server/runtime.py start_serving), over a model loaded once and shared by every worker
started from it. Cheaper than worker processes (no interpreter start, no second load), so a test
can pair prefill and decode workers for many models."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any


class Worker:
    def __init__(self, client: Any, state: Any, engine: Any, serve: Callable[[], Awaitable[None]]):
        self.client = client
        self.state = state
        self.engine = engine  # the synchronous Engine
        self.transport = None
        self.url = state.settings.advertise_url
        self._serve = serve

    async def serve(self) -> None:
        """Start the engine thread and the transport and mark the worker ready, as a process does."""
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


class InProcessWorkers:
    """Starts workers over one loaded model; `close()` stops them all and reports leaked blocks."""

    def __init__(self, loaded: Any, model_dir: str, **defaults: Any):
        self.loaded = loaded
        self.model_dir = model_dir
        self.defaults = dict(num_blocks=128, block_size=8, max_num_seqs=8, max_batched_tokens=256) | defaults
        self.started: list[Worker] = []

    async def start(self, role: str = "colocated", kv_backend: str | None = None, lease_s: float = 30.0,
                    attach: bool = True, secret: str | None = None, stall_s: float = 120.0,
                    serve_kv: bool | None = None, kv_compat: str = "g1", **overrides: Any) -> Worker:
        """`serve_kv`: whether the transport serves KV (default: every role but decode; a decode
        worker that migrates its sequences out serves them)."""
        from aiohttp.test_utils import TestClient, TestServer
        from tandem.contracts.names import Role
        from tandem.worker.engine.config import EngineConfig
        from tandem.worker.engine.engine import Engine
        from tandem.worker.kv.base import KVTransferConfig
        from tandem.worker.server.app import WorkerSettings, WorkerState, create_app
        from tandem.worker.server.runtime import start_serving

        engine_id = f"test-{role}-{uuid.uuid4().hex[:8]}"
        state = WorkerState(WorkerSettings(role=Role(role), advertise_url="", engine_id=engine_id,
                                           kv_compat=kv_compat, reserve_wait_s=2.0, internal_secret=secret))
        eng = Engine(EngineConfig(model=self.model_dir, **self.defaults | overrides), loaded=self.loaded,
                     lease_s=lease_s, on_step=state.metrics.observe_step)
        client = TestClient(TestServer(create_app(state)))
        await client.start_server()
        state.settings.advertise_url = str(client.make_url("")).rstrip("/")
        kv_config = KVTransferConfig(backend=kv_backend or "none", timeout_s=5.0, lease_s=lease_s,
                                     extra={"kv_metrics": state.metrics.kv_transfer},
                                     secret=secret, serve=role != "decode" if serve_kv is None else serve_kv)
        w = Worker(client, state, eng, lambda: start_serving(state, eng, stall_s=stall_s,
                                                             kv_backend=kv_backend or "none", kv_config=kv_config))
        self.started.append(w)
        if attach:
            await w.serve()
        return w

    async def close(self) -> list[str]:
        """Stop every worker; returns what each still held (empty when nothing leaked)."""
        errors = []
        for w in self.started:
            try:
                await w.wait_idle()
            except AssertionError as e:
                errors.append(str(e))
            await w.client.close()
            if w.state.engine is not None:
                await w.state.engine.stop()
            if w.state.transport is not None:
                await w.state.transport.close()
        self.started = []
        return errors
