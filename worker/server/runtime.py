"""A worker process's life in four steps, each a method of `WorkerRuntime`:

- boot: the HTTP server listens (so /health answers while a large model loads) and SIGTERM/SIGINT
  are caught; the advertised URL is known from here on.
- ready: the model loads (off the event loop), the KV transport starts, the engine thread runs,
  everything wired through constructors (`start_serving`), and /ready turns 200.
- drain (after the stop signal): /ready 503 and new requests 503 `draining`; a decode worker
  hands its sequences to other decode workers (`--migrate-on-drain`), then the drain waits up to
  `drain_s` for sequences to finish, leases to be pulled and every stream to write its last line.
- stop: what is left is aborted (its streams end with finish_reason abort: the router resumes
  them), then the server, the engine thread and the transport close.

The in-process test workers start through `start_serving` too, so they wire exactly what a
process does.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web
from tandem.contracts.names import KVBackend
from tandem.worker.server.app import create_app
from tandem.worker.server.config import WorkerConfig
from tandem.worker.server.state import WorkerSettings, WorkerState

if TYPE_CHECKING:  # torch loads only in ready(), so /health answers while it imports
    from tandem.worker.engine.engine import Engine
    from tandem.worker.kv.base import KVTransferConfig

log = logging.getLogger("tandem.worker")

SHUTDOWN_GRACE_S = 5.0  # after the drain, streams still open get this long to send their last line


class StartupError(RuntimeError):
    """The model or the KV transport could not start (the message says why; /ready reports it)."""


async def start_serving(state: WorkerState, engine: Engine, *, stall_s: float, kv_backend: str = "none",
                        kv_config: KVTransferConfig | None = None, group: Any = None) -> None:
    """Run `engine` for `state`: its step thread, the KV transport (unless "none") with the engine
    as its lease keeper, the worker's metrics fed through constructor callbacks; then mark the
    worker ready. StartupError when the transport cannot start. `group`: a tensor-parallel
    worker's rank 0 side (engine/parallel/rank_zero.py), which waits for its other ranks to serve and
    makes the transport the group's."""
    from tandem.worker.engine.async_engine import AsyncEngine
    from tandem.worker.engine.heap import freeze_startup_heap
    from tandem.worker.engine.kv_pull import KVEndpoint

    s = state.settings
    aeng = AsyncEngine(engine, stall_s=stall_s, on_step_gap=state.metrics.step_gap_seconds.observe,
                       on_pulled=state.metrics.observe_pull)
    transport, endpoint = None, None
    if kv_backend != KVBackend.NONE:
        from tandem.worker.kv.registry import create_transport

        try:
            transport = create_transport(kv_backend, engine.pool, engine.layout, s.engine_id, kv_config,
                                         leases=aeng)
            await transport.start()
        except Exception as e:  # noqa: BLE001 - report any backend failure the same way
            raise StartupError(f"KV backend {kv_backend!r} failed to start: {e}") from e
    if group is not None:
        transport = await group.serving(transport)
        if transport is not None:
            transport.verify = s.kv_verify  # the ranks check their heads of each pull too
    if transport is not None:
        s.kv_backend = transport.name
        endpoint = KVEndpoint(transport, s.advertise_url, s.engine_id, s.kv_compat, s.reserve_wait_s,
                              verify=s.kv_verify, on_verdict=state.metrics.observe_verify)
    frozen = freeze_startup_heap()
    log.info("froze the start-up heap (%d objects) out of the garbage collector's walks", frozen)
    aeng.start(endpoint)
    state.engine, state.transport, state.ready = aeng, transport, True


async def wait_drained(engine: Any, within: float, open_streams: Callable[[], int] = lambda: 0) -> bool:
    """Until running sequences finished (or migrated), other workers pulled leased KV, and every
    stream wrote its last line (a FINISH, or the MIGRATE of a sequence handed out without KV, which
    no lease keeps the drain waiting for), for `within` seconds at most; whether that happened."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if engine.idle() and open_streams() == 0:
            return True
        await asyncio.sleep(0.05)  # the engine thread finishes them; nothing to await on here
    return False


class WorkerRuntime:
    """One worker process: boot, ready, drain, stop (see the module docstring)."""

    def __init__(self, cfg: WorkerConfig, engine_id: str, *,
                 load_engine: Callable[[WorkerConfig, Callable[[float, int], None]], Engine] | None = None,
                 advertise_url: Callable[[int], str] = lambda port: f"http://127.0.0.1:{port}"):
        """`load_engine(cfg, on_step)`: build the engine (default: load cfg.model); `advertise_url(port)`:
        the base URL peers reach this worker at, once its port is known."""
        self.cfg = cfg
        self.state = WorkerState(WorkerSettings(
            role=cfg.role, advertise_url="", engine_id=engine_id, kv_compat=cfg.kv_compat or "",
            kv_backend=str(cfg.kv_backend), served_name=cfg.served_name, reserve_wait_s=cfg.kv_reserve_wait_s,
            prefill_queue_s=cfg.prefill_queue_s, internal_secret=cfg.internal_secret,
            heartbeat_s=cfg.heartbeat_s, kv_verify=cfg.kv_verify))
        self._load_engine = load_engine or _load_engine
        self._advertise_url = advertise_url
        self._runner: web.AppRunner | None = None
        self._stop_requested = asyncio.Event()
        self._handing_out = False
        self._group: Any = None  # tensor parallelism: rank 0's side of the group (engine/parallel/rank_zero.py)

    async def boot(self) -> None:
        """Listen for HTTP and for the stop signals."""
        self._runner = web.AppRunner(create_app(self.state), handler_cancellation=True, access_log=None,
                                     shutdown_timeout=SHUTDOWN_GRACE_S)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.cfg.host, self.cfg.port).start()
        port = self._runner.addresses[0][1]
        self.state.settings.advertise_url = self._advertise_url(port)
        self._catch_signals()
        log.info("listening on %s:%d (advertised as %s), role %s, engine_id %s", self.cfg.host, port,
                 self.state.settings.advertise_url, self.cfg.role.value, self.state.settings.engine_id)

    async def ready(self) -> None:
        """Load the model, start the transport and the engine thread; StartupError (also reported
        by /ready) when either fails."""
        from tandem.worker.engine.errors import ModelLoadError

        cfg, state = self.cfg, self.state
        load = self._load_engine
        try:
            if cfg.tensor_parallel > 1:  # its other ranks start now, on this (the main) thread
                from tandem.worker.engine.parallel.rank_zero import RankZero

                self._group = RankZero(cfg, state.settings.engine_id, state.settings.advertise_url)
                self._group.start()
                load = self._group.load_engine
            engine = await asyncio.to_thread(load, cfg, state.metrics.observe_step)
        except (ModelLoadError, ValueError, RuntimeError) as e:  # RuntimeError: a group that did not form
            state.load_error = str(e)
            raise StartupError(f"cannot start the engine: {e}") from e
        host = state.settings.advertise_url.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
        kv_config = cfg.kv_transfer_config(host, {"kv_metrics": state.metrics.kv_transfer})
        try:
            await start_serving(state, engine, stall_s=cfg.engine_stall_s, kv_backend=str(cfg.kv_backend),
                                kv_config=kv_config, group=self._group)
        except StartupError as e:
            state.load_error = str(e)
            raise
        self._catch_signals()  # again: a transfer library may have replaced the handlers while it started
        log.info("ready: serving %s (max_model_len %d, %d KV blocks of %d tokens, kv backend %s)",
                 engine.served_name, engine.max_model_len, engine.layout.num_blocks, engine.layout.block_size,
                 cfg.kv_backend.value)

    async def until_stopped(self) -> None:
        """Until SIGTERM or SIGINT (or request_stop())."""
        await self._stop_requested.wait()

    def request_stop(self) -> None:
        self._stop_requested.set()

    async def drain(self) -> None:
        """Stop taking requests; hand sequences out or let them finish; wait (bounded) for the rest."""
        state, aeng = self.state, self.state.engine
        state.ready, state.draining = False, True  # /ready 503 and new requests 503 draining
        if aeng is None:
            return
        self._hand_out_streams()
        if not await wait_drained(aeng.engine, self.cfg.drain_s, lambda: state.open_streams):
            log.warning("drain timed out with %d sequences and %d leases left", len(aeng.engine.seqs),
                        len(aeng.engine.leases))

    async def stop(self) -> None:
        """Abort what is left, then close the server, the engine thread and the transport."""
        state = self.state
        state.ready = False
        if state.engine is not None:
            for rid in list(state.engine.engine.seqs):  # their streams end with finish_reason abort
                state.engine.abort(rid)
        log.info("shutting down")
        if self._runner is not None:
            await self._runner.cleanup()
        if state.engine is not None:
            await state.engine.stop()
        if self._group is not None:  # after the last step: the other ranks leave (or die with this one)
            await asyncio.to_thread(self._group.close)
        if state.transport is not None:
            await state.transport.close()

    def _catch_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal)

    def _on_signal(self) -> None:
        """Stop; a decode worker that hands its streams out starts to at once, in the signal's own
        callback: the engine thread keeps stepping until it does, and the drain begins only some
        event-loop turns later (under load, long enough for its streams to run to their end here)."""
        self._stop_requested.set()
        if self.state.engine is not None:
            self.state.ready, self.state.draining = False, True  # as drain() does, now
            self._hand_out_streams()

    def _hand_out_streams(self) -> None:
        """A decode worker that migrates on drain hands every sequence out (once): each stream ends
        with MIGRATE, and the drain waits for the pulls."""
        aeng = self.state.engine
        if aeng is None or not self.cfg.migrate_on_drain or self.state.transport is None or self._handing_out:
            return
        self._handing_out = True
        log.info("draining: handing %d sequences to other decode workers", len(aeng.engine.seqs))
        aeng.start_migration()


def _load_engine(cfg: WorkerConfig, on_step: Callable[[float, int], None]) -> Engine:
    from tandem.worker.engine.engine import Engine

    return Engine(cfg.engine_config(), lease_s=cfg.kv_lease_s, on_step=on_step)
