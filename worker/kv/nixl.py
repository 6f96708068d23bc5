"""The NIXL backend: one-sided RDMA READs of whole block runs (UCX: verbs in a cluster, TCP on loopback).

Each worker registers its whole pool with its NIXL agent once at start() and
publishes the agent's metadata (base64), the pool's base address and memory
type in /internal/kv/metadata (behind the service's internal secret). The
decode side adds the remote agent when it first meets an engine_id (and removes
it when that engine is replaced or a transfer to it fails), builds descriptor
lists for the merged runs (addresses inside the two registered pools: nothing
is copied or serialised) and posts a READ carrying a notification
{"request_id", "engine_id", "lease_token", "bytes"}. UCX delivers the
notification to the prefill agent after the data; the prefill side's poll loop
turns it into leases.release_lease(request_id, lease_token): a wrong token
frees nothing. What a lease token can and cannot protect over one-sided RDMA is
in worker/kv/README.md.

Known limit: the completion signal is one-way, so unlike tcp (whose release
exchange fails the pull when the prefill side's lease had expired) a READ that
outlives the prefill worker's lease cannot be told its blocks were reclaimed.
Pulls are bounded by timeout_s (10 s) and start as soon as the decode worker
receives the request, so keep lease_s (30 s) well above timeout_s.

Off the event loop: every agent call runs on one thread (nixl_thread.py: why,
and which calls block), awaited here with a bound (config.timeout_s; nixl_start_s
for registering the pool at start-up). A wedged call fails the pulls queued
behind it within their bound; it never stalls HTTP.

Progress: the agent runs without NIXL's progress thread by default
(config.extra["nixl_progress_thread"]=False), because on this build that thread
busy-polls a whole core, which on a CPU worker is the model's. Progress then
happens when the agent thread polls: check_xfer_state while a READ is in flight
(decode side), and get_new_notifs (which also lets UCX answer the READ over TCP,
where it is not truly one-sided) on a short interval (config.extra["nixl_poll_s"],
1 ms) while a pull is expected (source_extra() is called once per prefill result
handed out) or within a second of traffic, and every nixl_idle_poll_s (5 ms)
otherwise: measured here, a 128 MiB READ takes ~2x longer when the target polls
every 5 ms instead of every 1 ms, and 0.1 ms gains nothing over 1 ms.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from tandem.contracts.kv_health import TransportInfo
from tandem.contracts.kv_layout import KVLayout
from tandem.worker.kv.base import KVTransferConfig, KVTransferError, TransferState
from tandem.worker.kv.byte_ranges import Range
from tandem.worker.kv.health import detect_ucx_transport
from tandem.worker.kv.nixl_thread import AgentThread
from tandem.worker.kv.pull_transport import PullTransport

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
        self._reg: Any = None
        self._agent_md = b""
        self._mem_type, self._dev = _mem(pool)
        self._base = pool.data_ptr()
        self._poll_s = float(config.extra.get("nixl_poll_s", 0.001))
        self._idle_poll_s = float(config.extra.get("nixl_idle_poll_s", 0.005))
        self._start_s = float(config.extra.get("nixl_start_s", 300.0))
        self._last_traffic = 0.0
        self._expected = 0  # prefill results handed out whose pull has not been notified yet
        self._remote_names: dict[str, str] = {}  # engine_id -> NIXL agent name
        self._agent = AgentThread(f"tandem-nixl-{engine_id}",
                                  self._notif_interval if config.serve else None, self._on_notifs)

    def _transport_info(self) -> TransportInfo:
        return dataclasses.replace(detect_ucx_transport(), nixl_backend="UCX")

    # --- calls on the agent thread ------------------------------------------------------------

    async def _call(self, what: str, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> Any:
        """fn(*args) on the agent thread; KVTransferError (TIMED_OUT) if it has not returned within
        the bound (it keeps running there; the calls behind it wait their turn)."""
        bound = self.config.timeout_s if timeout_s is None else timeout_s
        return await self._await(what, self._agent.submit(fn, *args), bound)

    @staticmethod
    async def _await(what: str, cfut: concurrent.futures.Future, bound: float | None) -> Any:
        """The result of a future the agent thread resolves, waiting at most `bound` (None: no
        bound of its own; the caller's applies)."""
        fut = asyncio.wrap_future(cfut)
        done, _ = await asyncio.wait({fut}, timeout=bound)
        if not done:
            fut.cancel()  # withdraws it only if it has not started
            raise KVTransferError(f"NIXL {what} did not return within {bound} s", TransferState.TIMED_OUT)
        return fut.result()

    async def _settle(self, what: str, fn: Callable[[], Any], request_id: str | None = None) -> None:
        """Run fn on the agent thread and wait for it even through cancellation (at most timeout_s):
        it stops a READ, and nothing may still write into our pool once _read is left. If it has
        not returned by then, the READ of `request_id` may still land: still_writing() says so
        until it returns, and the caller keeps the destination blocks out of use."""
        fut = asyncio.wrap_future(self._agent.submit(fn))
        deadline = time.monotonic() + self.config.timeout_s
        cancelled = False
        while not fut.done() and time.monotonic() < deadline:
            try:
                await asyncio.wait({fut}, timeout=deadline - time.monotonic())
            except asyncio.CancelledError:
                cancelled = True
        if not fut.done():
            log.error("NIXL %s still running after %s s: its READ may yet land", what, self.config.timeout_s)
            if request_id is not None:
                self._writing(request_id, fut)
        elif fut.exception() is not None:
            log.warning("NIXL %s failed: %s", what, fut.exception())
        if cancelled:
            raise asyncio.CancelledError

    async def start(self) -> None:
        def make() -> tuple[Any, bytes]:
            conf = nixl_agent_config(
                enable_prog_thread=bool(self.config.extra.get("nixl_progress_thread", False)),
                backends=["UCX"])
            agent = nixl_agent(self.engine_id, conf)
            if "UCX" not in agent.backends:
                raise RuntimeError("NIXL has no UCX backend here: use the tcp KV backend")
            reg = agent.register_memory(self.pool)
            self._agent.agent = agent
            return reg, agent.get_agent_metadata()

        self._last_traffic = time.monotonic()
        self._agent.start(asyncio.get_running_loop())
        self._reg, self._agent_md = await self._call("agent start (registering the pool)", make,
                                                     timeout_s=self._start_s)

    async def close(self) -> None:
        await self._close_shared()
        if not self._agent.started:
            return

        def teardown() -> None:  # the agent's last reference goes here: UCX's flush runs off the loop
            agent, self._agent.agent = self._agent.agent, None
            if agent is not None and self._reg is not None:
                agent.deregister_memory(self._reg)

        try:
            await self._call("teardown", teardown)
        except Exception as e:  # noqa: BLE001 - closing is best effort
            log.warning("NIXL teardown failed: %s", e)
        self._agent.stop()

    def metadata(self) -> dict[str, Any]:
        return self._base_metadata() | {
            "agent_name": self.engine_id,
            "agent_metadata": base64.b64encode(self._agent_md).decode(),
            "base_address": self._base,
            "mem_type": self._mem_type,
            "device_id": self._dev,
        }

    # --- prefill side: completion notifications -----------------------------------------------

    def source_extra(self) -> dict[str, Any]:
        """Called once per prefill result handed out: a READ is coming, so poll fast until it is done."""
        self._expected += 1
        self._last_traffic = time.monotonic()
        self._agent.wake()
        return {}

    def _notif_interval(self) -> float:
        """Read on the agent thread: how soon to poll for notifications again."""
        now = time.monotonic()
        if self._expected and now - self._last_traffic > self.config.lease_s:
            self._expected = 0  # those leases expired: nobody is coming for them
        busy = self._expected > 0 or now - self._last_traffic < 1.0
        return self._poll_s if busy else self._idle_poll_s

    def _on_notifs(self, notifs: dict[str, list[bytes]]) -> None:
        now = time.monotonic()
        for msgs in notifs.values():
            for raw in msgs:
                self._on_notif(raw)
                self._expected = max(0, self._expected - 1)
                self._last_traffic = now

    def _on_notif(self, raw: bytes) -> None:
        try:
            msg = json.loads(raw)
        except ValueError:
            msg = None
        if not isinstance(msg, dict) or not isinstance(msg.get("request_id"), str):
            log.warning("ignoring a NIXL notification that is not Tandem's: %r", raw[:80])
            return
        if msg.get("engine_id") != self.engine_id:
            return  # meant for this pod's predecessor
        rid, token = msg["request_id"], msg.get("lease_token")
        if msg.get("release") is False:  # one rank's READ of a tensor-parallel pull: released at rank 0
            self.kv_health.success("serve", int(msg.get("bytes", 0)))
            return
        if not isinstance(token, str) or not self.leases.release_lease(rid, token):
            # A READ cannot be checked per block (README): this only refuses to free on its word.
            self.kv_health.failure("serve", f"{rid}: completion without the lease's token, or after it ended")
            log.warning("a NIXL completion quoted no live lease with that token: nothing freed",
                        extra={"request_id": rid})
            return
        self.kv_health.success("serve", int(msg.get("bytes", 0)))

    # --- decode side: READ --------------------------------------------------------------------

    async def _add_peer(self, md: dict[str, Any]) -> None:
        def add() -> str:
            return self._agent.agent.add_remote_agent(base64.b64decode(md["agent_metadata"]))

        name = await self._call("add_remote_agent", add)
        if isinstance(name, bytes):
            name = name.decode()
        if name != md["agent_name"]:
            raise KVTransferError(f"NIXL metadata names agent {name}, expected {md['agent_name']}")
        self._remote_names[md["engine_id"]] = name

    async def _forget_peer(self, md: dict[str, Any]) -> None:
        name = self._remote_names.pop(md["engine_id"], None)
        if name is None:
            return

        def remove() -> None:
            if self._agent.agent is not None:
                self._agent.agent.remove_remote_agent(name)

        try:
            await self._call("remove_remote_agent", remove)
        except Exception as e:  # noqa: BLE001 - forgetting is best effort
            log.warning("removing NIXL agent %s failed: %s", name, e)

    async def _read(self, md: dict[str, Any], request_id: str, lease_token: str, ranges: list[Range],
                    release: bool) -> int:
        notif = json.dumps({"request_id": request_id, "engine_id": md["engine_id"],
                            "lease_token": lease_token, "release": release,
                            "bytes": sum(n for _, _, n in ranges)}).encode()
        posted: list[Any] = []  # the handle, once the agent thread has made it

        def post() -> concurrent.futures.Future:
            agent = self._agent.agent
            local = agent.get_xfer_descs(np.array(
                [(self._base + d, n, self._dev) for _, d, n in ranges], dtype=np.uint64), self._mem_type)
            remote = agent.get_xfer_descs(np.array(
                [(md["base_address"] + s, n, md["device_id"]) for s, _, n in ranges],
                dtype=np.uint64), md["mem_type"])
            try:
                handle = agent.initialize_xfer("READ", local, remote, md["agent_name"], notif)
            except Exception as e:  # nixlBind raises its own exception types
                raise KVTransferError(f"NIXL could not prepare the READ from {md['engine_id']}: {e}") from e
            posted.append(handle)
            state = agent.transfer(handle)
            if state == "PROC":
                return self._agent.watch(handle)
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(state)
            return done

        finished = False
        try:
            try:
                watching = await self._call("READ setup", post)
                state = await self._await("READ", watching, None)  # pull() bounds it
            except KVTransferError:
                raise
            except Exception as e:  # e.g. nixlRemoteDisconnectError when the peer died
                raise KVTransferError(f"NIXL READ from {md['engine_id']} failed: "
                                      f"{type(e).__name__}: {e}") from e
            if state != "DONE":
                raise KVTransferError(f"NIXL READ from {md['engine_id']} failed ({state})")
            finished = True
        finally:
            if not finished:
                log.info("aborting the unfinished NIXL READ of %s", request_id)
            await self._settle("release of a READ", lambda: self._release(posted, md),
                               None if finished else request_id)
        return len(ranges)

    def _release(self, posted: list[Any], md: dict[str, Any]) -> None:
        """On the agent thread: free the transfer; an unfinished one is aborted, disconnecting the
        peer if NIXL refuses."""
        if not posted:
            return
        handle = posted[0]
        self._agent.unwatch(handle)
        try:
            handle.release()
            return
        except Exception as e:  # noqa: BLE001 - NIXL raises its own types
            log.warning("releasing an unfinished NIXL READ failed (%s): disconnecting %s",
                        e, md["engine_id"])
        name = self._remote_names.pop(md["engine_id"], None)
        try:
            if name is not None:
                self._agent.agent.remove_remote_agent(name)
            handle.release()
        except Exception as e:  # noqa: BLE001
            log.warning("could not release the NIXL READ after disconnecting: %s", e)
