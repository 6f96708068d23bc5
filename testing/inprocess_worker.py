"""Workers inside the test process: a real engine thread, the worker's aiohttp app on a loopback
port and, when asked, a real KV transport (tcp, nixl or memory), over a model loaded once and
shared by every worker started from it. Cheaper than worker processes (no interpreter start, no
second load), so a test can pair prefill and decode workers for many models."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any


class Worker:
    def __init__(self, client: Any, state: Any, engine: Any, transport: Any = None):
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


class InProcessWorkers:
    """Starts workers over one loaded model; `close()` stops them all and reports leaked blocks."""

    def __init__(self, loaded: Any, model_dir: str, **defaults: Any):
        self.loaded = loaded
        self.model_dir = model_dir
        self.defaults = dict(num_blocks=128, block_size=8, max_num_seqs=8, max_batched_tokens=256) | defaults
        self.started: list[tuple[Worker, Any, Any]] = []

    async def start(self, role: str = "colocated", kv_backend: str | None = None, lease_s: float = 30.0,
                    attach: bool = True, secret: str | None = None, stall_s: float = 120.0,
                    serve_kv: bool | None = None, **overrides: Any) -> Worker:
        """`serve_kv`: whether the transport serves KV (default: every role but decode; a decode
        worker that migrates its sequences out serves them)."""
        from aiohttp.test_utils import TestClient, TestServer
        from tandem.contracts.names import Role
        from tandem.worker.engine.async_engine import AsyncEngine
        from tandem.worker.engine.config import EngineConfig
        from tandem.worker.engine.engine import Engine
        from tandem.worker.engine.kv_pull import KVEndpoint
        from tandem.worker.server.app import WorkerSettings, WorkerState, attach_engine, create_app

        eng = Engine(EngineConfig(model=self.model_dir, **self.defaults | overrides), loaded=self.loaded,
                     lease_s=lease_s)
        engine_id = f"test-{role}-{uuid.uuid4().hex[:8]}"
        state = WorkerState(WorkerSettings(role=Role(role), advertise_url="", engine_id=engine_id,
                                           generation="g1", reserve_wait_s=2.0, internal_secret=secret))
        client = TestClient(TestServer(create_app(state)))
        await client.start_server()
        state.settings.advertise_url = str(client.make_url("")).rstrip("/")
        aeng = AsyncEngine(eng, stall_s=stall_s, on_step_gap=state.metrics.step_gap_seconds.observe,
                           on_pulled=state.metrics.observe_pull)
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
        self.started.append((w, aeng, transport))
        if attach:
            aeng.start(None if transport is None else KVEndpoint(
                transport, state.settings.advertise_url, engine_id, state.settings.generation,
                state.settings.reserve_wait_s))
            attach_engine(state, aeng, transport)
        return w

    async def close(self) -> list[str]:
        """Stop every worker; returns what each still held (empty when nothing leaked)."""
        errors = []
        for w, aeng, transport in self.started:
            try:
                await w.wait_idle()
            except AssertionError as e:
                errors.append(str(e))
            await w.client.close()
            if aeng._thread is not None:
                await aeng.stop()
            if transport is not None:
                await transport.close()
        self.started = []
        return errors
