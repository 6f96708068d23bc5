"""The NIXL backend: one-sided RDMA READs of whole block runs (UCX: verbs in a cluster, TCP on loopback).

Each worker registers its whole pool with its NIXL agent once at start() and
publishes the agent's metadata (base64), the pool's base address and memory
type in /internal/kv/metadata. The decode side adds the remote agent when it
first meets an engine_id (and removes it when that engine is replaced or a
transfer to it fails), builds descriptor lists for the merged runs (addresses
inside the two registered pools: nothing is copied or serialised) and posts a
READ carrying a notification {"request_id", "engine_id", "bytes"}. UCX delivers
the notification to the prefill agent after the data; the prefill side's poll
loop turns it into on_released(request_id).

Known limit: the completion signal is one-way, so unlike tcp (whose release
exchange fails the pull when the prefill side's lease had expired) a READ that
outlives the prefill worker's lease cannot be told its blocks were reclaimed.
Pulls are bounded by timeout_s (10 s) and start as soon as the decode worker
receives the request, so keep lease_s (30 s) well above timeout_s.

Progress: the agent runs without NIXL's progress thread by default
(config.extra["nixl_progress_thread"]=False), because on this build that thread
busy-polls a whole core, which on a CPU worker is the model's. Progress then
happens when we poll: the decode side polls check_xfer_state while a READ is in
flight, and the prefill side polls get_new_notifs (which also lets UCX answer
the READ over TCP, where it is not truly one-sided) on a short interval
(config.extra["nixl_poll_s"], 1 ms) while a pull is expected (source_extra() is
called once per prefill result handed out) or within a second of traffic, and
every nixl_idle_poll_s (5 ms) otherwise: measured here, a 128 MiB READ takes
~2x longer when the target polls every 5 ms instead of every 1 ms, and 0.1 ms
gains nothing over 1 ms.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import numpy as np
from tandem.contracts.kv_health import TransportInfo
from tandem.contracts.kv_layout import KVLayout
from tandem.worker.kv.base import KVTransferConfig, KVTransferError
from tandem.worker.kv.health import detect_ucx_transport
from tandem.worker.kv.pulling import PullTransport

try:  # the upstream wheel is `nixl`; the CPU-only CUDA 12 build installs as `nixl_cu12`
    from nixl._api import nixl_agent, nixl_agent_config
except ImportError:
    from nixl_cu12._api import nixl_agent, nixl_agent_config

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def _mem(pool: torch.Tensor) -> tuple[str, int]:
    """NIXL memory type and device id of a tensor."""
    return ("VRAM", pool.device.index or 0) if pool.device.type == "cuda" else ("DRAM", 0)


class NixlTransport(PullTransport):
    """Pull with NIXL READs; completion comes back to the prefill side as a NIXL notification."""

    name = "nixl"

    def __init__(self, pool: torch.Tensor, layout: KVLayout, engine_id: str, config: KVTransferConfig):
        if not pool.is_contiguous():
            raise ValueError("the KV pool must be one contiguous tensor")
        for k, v in config.extra.get("ucx_env", {}).items():  # read by UCX when the agent starts
            os.environ[k] = str(v)
        super().__init__(pool, layout, engine_id, config)
        self.agent: Any = None
        self._reg: Any = None
        self._mem_type, self._dev = _mem(pool)
        self._base = pool.data_ptr()
        self._poll_task: asyncio.Task | None = None
        self._poll_s = float(config.extra.get("nixl_poll_s", 0.001))
        self._idle_poll_s = float(config.extra.get("nixl_idle_poll_s", 0.005))
        self._last_traffic = 0.0
        self._expected = 0  # prefill results handed out whose pull has not been notified yet
        self._wake = asyncio.Event()
        self._remote_names: dict[str, str] = {}  # engine_id -> NIXL agent name

    def _transport_info(self) -> TransportInfo:
        return dataclasses.replace(detect_ucx_transport(), nixl_backend="UCX")

    async def start(self) -> None:
        def make() -> tuple[Any, Any]:
            conf = nixl_agent_config(
                enable_prog_thread=bool(self.config.extra.get("nixl_progress_thread", False)),
                backends=["UCX"])
            agent = nixl_agent(self.engine_id, conf)
            if "UCX" not in agent.backends:
                raise RuntimeError("NIXL has no UCX backend here: use the tcp KV backend")
            return agent, agent.register_memory(self.pool)

        self.agent, self._reg = await asyncio.to_thread(make)
        self._last_traffic = time.monotonic()
        self._poll_task = asyncio.get_running_loop().create_task(self._poll_notifs())

    async def close(self) -> None:
        if self._poll_task is not None:
            self._poll_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poll_task
        await self._close_shared()
        if self.agent is not None and self._reg is not None:
            with contextlib.suppress(Exception):
                self.agent.deregister_memory(self._reg)
        self.agent = None

    def metadata(self) -> dict[str, Any]:
        return self._base_metadata() | {
            "agent_name": self.engine_id,
            "agent_metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
            "base_address": self._base,
            "mem_type": self._mem_type,
            "device_id": self._dev,
        }

    # --- prefill side: completion notifications -----------------------------------------------

    def source_extra(self) -> dict[str, Any]:
        """Called once per prefill result handed out: a READ is coming, so poll fast until it is done."""
        self._expected += 1
        self._last_traffic = time.monotonic()
        self._wake.set()
        return {}

    async def _poll_notifs(self) -> None:
        while True:
            try:
                notifs = self.agent.get_new_notifs()
            except Exception:  # keep polling: one bad poll must not stop every future release
                log.exception("polling NIXL notifications failed")
                notifs = {}
            now = time.monotonic()
            for msgs in notifs.values():
                for raw in msgs:
                    self._on_notif(raw)
                    self._expected = max(0, self._expected - 1)
                    self._last_traffic = now
            if self._expected and now - self._last_traffic > self.config.lease_s:
                self._expected = 0  # those leases expired: nobody is coming for them
            busy = self._expected > 0 or now - self._last_traffic < 1.0
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._poll_s if busy else self._idle_poll_s)

    def _on_notif(self, raw: bytes) -> None:
        try:
            msg = json.loads(raw)
        except ValueError:
            log.warning("ignoring a NIXL notification that is not Tandem's: %r", raw[:80])
            return
        if msg.get("engine_id") != self.engine_id:
            return  # meant for this pod's predecessor
        self.kv_health.success("serve", int(msg.get("bytes", 0)))
        self.on_released(msg["request_id"])

    # --- decode side: READ --------------------------------------------------------------------

    async def _add_peer(self, md: dict[str, Any]) -> None:
        name = self.agent.add_remote_agent(base64.b64decode(md["agent_metadata"]))
        if isinstance(name, bytes):
            name = name.decode()
        if name != md["agent_name"]:
            raise KVTransferError(f"NIXL metadata names agent {name}, expected {md['agent_name']}")
        self._remote_names[md["engine_id"]] = name

    async def _forget_peer(self, md: dict[str, Any]) -> None:
        name = self._remote_names.pop(md["engine_id"], None)
        if name is not None and self.agent is not None:
            self.agent.remove_remote_agent(name)

    async def _read(self, md: dict[str, Any], request_id: str, runs: list[tuple[int, int, int]]) -> int:
        bb = self.layout.block_bytes
        agent = self.agent
        local = agent.get_xfer_descs(np.array(
            [(self._base + d * bb, c * bb, self._dev) for _, d, c in runs], dtype=np.uint64),
            self._mem_type)
        remote = agent.get_xfer_descs(np.array(
            [(md["base_address"] + s * bb, c * bb, md["device_id"]) for s, _, c in runs],
            dtype=np.uint64), md["mem_type"])
        notif = json.dumps({"request_id": request_id, "engine_id": md["engine_id"],
                            "bytes": sum(c for _, _, c in runs) * bb}).encode()
        try:
            handle = agent.initialize_xfer("READ", local, remote, md["agent_name"], notif)
        except Exception as e:  # nixlBind raises its own exception types
            raise KVTransferError(f"NIXL could not prepare the READ from {md['engine_id']}: {e}") from e
        done = False
        try:
            try:
                state = agent.transfer(handle)
                delay = 0.0002
                while state == "PROC":
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 0.002)
                    state = agent.check_xfer_state(handle)
            except Exception as e:  # e.g. nixlRemoteDisconnectError when the peer died
                raise KVTransferError(f"NIXL READ from {md['engine_id']} failed: "
                                      f"{type(e).__name__}: {e}") from e
            if state != "DONE":
                raise KVTransferError(f"NIXL READ from {md['engine_id']} failed ({state})")
            done = True
        finally:
            if not done:
                log.info("aborting the unfinished NIXL READ of %s", request_id)
            self._release(handle, md)
        return len(runs)

    def _release(self, handle: Any, md: dict[str, Any]) -> None:
        """Free the transfer; an unfinished one is aborted, disconnecting the peer if NIXL refuses."""
        try:
            handle.release()
            return
        except Exception as e:
            log.warning("releasing an unfinished NIXL READ failed (%s): disconnecting %s",
                        e, md["engine_id"])
        name = self._remote_names.pop(md["engine_id"], None)
        with contextlib.suppress(Exception):
            if name is not None:
                self.agent.remove_remote_agent(name)
            handle.release()
