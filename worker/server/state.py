"""What the worker's routes share: its settings and its state (the engine once loaded)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web
from tandem.contracts import timing
from tandem.contracts.names import Role
from tandem.worker.server.metrics import WorkerMetrics

if TYPE_CHECKING:  # torch stays out of the import: the server starts before the model loads
    from tandem.worker.engine.async_engine import AsyncEngine
    from tandem.worker.kv.base import KVTransport


@dataclass
class WorkerSettings:
    role: Role
    advertise_url: str  # base URL peers and the router use to reach this worker
    engine_id: str  # "<pod or host>-<epoch>"
    kv_compat: str = ""
    kv_backend: str = "none"
    served_name: str | None = None
    # A handoff waits this long at most for free blocks to receive its KV, then answers 503 with
    # Retry-After (busy, never failed); with the pull's own bound it stays under the router's
    # chunk timeout (contracts/timing.py).
    reserve_wait_s: float = timing.KV_RESERVE_WAIT_S
    # A prefill waits this long at most in the queue before it starts, then answers 429 with
    # Retry-After: a prefill answers in one piece, and a long silence would look like a hang.
    prefill_queue_s: float = timing.PREFILL_QUEUE_S
    heartbeat_s: float = timing.HEARTBEAT_S  # a generate stream silent this long gets a heartbeat line
    kv_verify: bool = True  # digest KV handed out, check KV pulled (worker/kv/verify.py)
    # The service's internal secret (tandem.contracts.internal_auth); None: /internal/* is open.
    internal_secret: str | None = field(default=None, repr=False)


@dataclass
class WorkerState:
    """What the routes read; the engine and transport appear once start-up has loaded them."""

    settings: WorkerSettings
    engine: AsyncEngine | None = None
    transport: KVTransport | None = None
    ready: bool = False
    draining: bool = False  # SIGTERM came: new requests get 503 draining (busy: try another worker)
    open_streams: int = 0  # /internal/generate responses not yet ended: a drain waits for their last line
    load_error: str | None = None
    started: float = field(default_factory=time.time)
    metrics: WorkerMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = WorkerMetrics(lambda: self.engine.engine if self.engine is not None else None,
                                     self.engine_problem)

    def engine_problem(self) -> str | None:
        """Why the engine cannot serve although it was loaded (its thread died or stalls); None if fine."""
        return self.engine.health() if self.engine is not None else None


STATE_KEY = web.AppKey("tandem_worker_state", WorkerState)
