"""A KV pool with a transport and a tiny HTTP API, no engine: the two ends of a handoff in tests and bench.

A KVPeer owns a pool tensor of a given KVLayout, a block allocator with leases
and their tokens (what the engine does on a prefill worker: it is the transport's
LeaseKeeper) and serves the transport's /internal/kv/{metadata,health,release}
like a worker does, behind the same internal-secret middleware, plus test-only
endpoints (open) to fill blocks with a known pattern (/test/prefill), pull and
verify them (/test/pull) and count blocks (/test/blocks). Run in-process, or as
a process with `python -m tandem.testing.kv_peer ...` (prints "READY <url>"); the
process takes its secret from $TANDEM_INTERNAL_SECRET, as a worker does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Collection
from dataclasses import asdict
from typing import Any

import aiohttp
import torch
from aiohttp import web
from tandem.contracts.internal_auth import SECRET_ENV, auth_headers
from tandem.contracts.kv_layout import KVLayout
from tandem.contracts.kv_source import KVSource
from tandem.worker.kv.base import KVTransferConfig, KVTransferError, KVTransport
from tandem.worker.kv.registry import create_transport
from tandem.worker.local.processes import ManagedProcess
from tandem.worker.server.auth import internal_auth

# Small blocks (8 KiB) for correctness tests: thousands of tokens stay cheap.
SMALL_LAYOUT = KVLayout(num_blocks=1024, num_layers=2, block_size=16, num_kv_heads=2, head_dim=16,
                        dtype="float32")
# The ~40M-parameter Llama's layout (8 layers, 4 KV heads, head_dim 64, fp32): 256 KiB blocks, so a
# handoff is long enough to kill mid-flight and to measure bandwidth.
BENCH_LAYOUT = KVLayout(num_blocks=640, num_layers=8, block_size=16, num_kv_heads=4, head_dim=64,
                        dtype="float32")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def block_pattern(layout: KVLayout, seed: int, index: int) -> torch.Tensor:
    """The content of the index-th block of a request seeded `seed`: the same in every process."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    shape = layout.shape[1:]
    return torch.randn(shape, generator=g).to(DTYPES[layout.dtype])


class KVPeer:
    """A pool, its allocator with leases, and a transport: what a worker holds for KV handoff."""

    def __init__(self, backend: str, layout: KVLayout, engine_id: str,
                 config: KVTransferConfig | None = None, fill: bool = True):
        self.layout = layout
        self.config = config or KVTransferConfig(backend=backend)
        self.pool = torch.zeros(layout.shape, dtype=DTYPES[layout.dtype])
        self.free: set[int] = set(range(layout.num_blocks))
        self.leases: dict[str, tuple[list[int], float, str]] = {}  # request_id -> (blocks, deadline, token)
        self.fill = fill
        self.released: list[str] = []
        self.transport: KVTransport = create_transport(backend, self.pool, layout, engine_id, self.config)
        self.transport.leases = self
        self._reaper: asyncio.Task | None = None
        self._runner: web.AppRunner | None = None
        self.url = ""

    # --- allocator ----------------------------------------------------------------------------

    def allocate(self, n: int, scatter: bool = False) -> list[int]:
        if n > len(self.free):
            raise MemoryError(f"{n} blocks wanted, {len(self.free)} free")
        free = sorted(self.free)
        if scatter:  # non-adjacent ids exercise run merging and addressing
            blocks = random.Random(n).sample(free, n)
        else:
            blocks = free[:n]
        self.free.difference_update(blocks)
        return blocks

    def free_blocks(self, blocks: list[int]) -> None:
        assert not (set(blocks) & self.free), "double free"
        self.free.update(blocks)

    def release_lease(self, request_id: str, lease_token: str) -> bool:
        """LeaseKeeper: a peer finished (or abandoned) pulling this request's blocks; False, freeing
        nothing, if the lease is gone (expired, released) or the token is not its token."""
        lease = self.leases.get(request_id)
        if lease is None or not isinstance(lease_token, str) or not secrets.compare_digest(
                lease[2].encode(), lease_token.encode()):
            return False
        del self.leases[request_id]
        self.free_blocks(lease[0])
        self.released.append(request_id)
        return True

    def check_read(self, request_id: str, lease_token: str, block_ids: Collection[int]) -> bool:
        """LeaseKeeper: a live lease of request_id, proven by its token, holds every block."""
        lease = self.leases.get(request_id)
        return (lease is not None and secrets.compare_digest(lease[2].encode(), lease_token.encode())
                and lease[1] > time.monotonic() and set(block_ids) <= set(lease[0]))

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            now = time.monotonic()
            for rid, (_, deadline, token) in list(self.leases.items()):
                if deadline < now:
                    self.release_lease(rid, token)

    # --- both roles ---------------------------------------------------------------------------

    def prefill(self, request_id: str, num_tokens: int, seed: int, scatter: bool = False) -> KVSource:
        """Lease blocks for num_tokens, fill them with the seed's pattern and describe them."""
        blocks = self.allocate(self.layout.blocks_for(num_tokens), scatter)
        if self.fill:
            for i, b in enumerate(blocks):
                self.pool[b].copy_(block_pattern(self.layout, seed, i))
        token = secrets.token_urlsafe(32)
        self.leases[request_id] = (blocks, time.monotonic() + self.config.lease_s, token)
        return KVSource(url=self.url, engine_id=self.transport.engine_id, backend=self.transport.name,
                        block_ids=blocks, num_tokens=num_tokens, lease_token=token,
                        extra=self.transport.source_extra())

    def verify(self, blocks: list[int], seed: int) -> bool:
        return all(torch.equal(self.pool[b], block_pattern(self.layout, seed, i))
                   for i, b in enumerate(blocks))

    async def pull(self, request_id: str, source: KVSource, seed: int | None,
                   scatter: bool = False) -> dict[str, Any]:
        """Allocate, pull, verify against the pattern and free: one decode-side handoff."""
        blocks = self.allocate(len(source.block_ids), scatter)
        try:
            stats = await self.transport.pull(request_id, source, blocks)
            identical = self.verify(blocks, seed) if seed is not None else None
            return {"ok": True, "identical": identical, "stats": asdict(stats)}
        except KVTransferError as e:
            return {"ok": False, "error": str(e), "state": e.state.value}
        finally:
            self.free_blocks(blocks)

    # --- HTTP ---------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=[internal_auth(lambda: self.config.secret)])
        r = app.router
        r.add_get("/internal/kv/metadata", self._h_metadata)
        r.add_get("/internal/kv/health", self._h_health)
        r.add_post("/internal/kv/release", self._h_release)
        r.add_post("/test/prefill", self._h_prefill)
        r.add_post("/test/pull", self._h_pull)
        r.add_get("/test/blocks", self._h_blocks)
        return app

    async def _h_metadata(self, _: web.Request) -> web.Response:
        return web.json_response(self.transport.metadata())

    async def _h_health(self, _: web.Request) -> web.Response:
        return web.json_response(self.transport.health().to_dict())

    async def _h_blocks(self, _: web.Request) -> web.Response:
        conns = getattr(self.transport, "connections", None)
        return web.json_response({"free": len(self.free), "total": self.layout.num_blocks,
                                  "leased": len(self.leases), "released": len(self.released),
                                  "connections": conns() if conns else None})

    async def _h_release(self, req: web.Request) -> web.Response:
        b = await req.json()
        return web.json_response({"released": self.release_lease(b["request_id"], b.get("lease_token", ""))})

    async def _h_prefill(self, req: web.Request) -> web.Response:
        b = await req.json()
        src = self.prefill(b["request_id"], b["num_tokens"], b["seed"], b.get("scatter", False))
        return web.json_response(asdict(src))

    async def _h_pull(self, req: web.Request) -> web.Response:
        b = await req.json()
        return web.json_response(await self.pull(b["request_id"], KVSource(**b["source"]),
                                                 b.get("seed"), b.get("scatter", False)))

    async def start(self, port: int = 0, host: str = "127.0.0.1") -> str:
        await self.transport.start()
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://{host}:{port}"
        self._reaper = asyncio.get_running_loop().create_task(self._reap())
        return self.url

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
        await self.transport.close()


class KVPeerProcess(ManagedProcess):
    """A KVPeer in its own process (`python -m tandem.testing.kv_peer`), so tests can kill it."""

    def __init__(self, backend: str, layout: KVLayout, engine_id: str, *, port: int = 0,
                 timeout_s: float = 10.0, lease_s: float = 30.0, fill: bool = True,
                 env: dict[str, str] | None = None, tcp_port: int = 0,
                 extra: dict[str, Any] | None = None, secret: str | None = None):
        argv = [sys.executable, "-m", "tandem.testing.kv_peer", "--backend", backend,
                "--layout", json.dumps(layout.to_dict()), "--engine-id", engine_id,
                "--port", str(port), "--timeout-s", str(timeout_s), "--lease-s", str(lease_s),
                "--tcp-port", str(tcp_port), "--extra", json.dumps(extra or {})]
        argv += [] if fill else ["--no-fill"]
        self.secret = secret
        base = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
        super().__init__("kv-peer", argv, base | {"UCX_TLS": "tcp", "OMP_NUM_THREADS": "1"} | (env or {})
                         | ({SECRET_ENV: secret} if secret else {}))

    def start(self, ready_timeout_s: float = 60.0) -> str:
        # Not ManagedProcess.start(): the peer announces its URL on stdout ("READY <url>").
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=subprocess.PIPE, text=True)
        deadline = time.monotonic() + ready_timeout_s
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"kv peer exited with {self.proc.wait()} before it was ready")
            if line.startswith("READY "):
                self.url = line.split()[1]
                return self.url
        self.kill()
        raise RuntimeError("kv peer not ready in time")

    async def _call(self, method: str, path: str, body: dict | None = None,
                    timeout_s: float = 30.0) -> dict[str, Any]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s),
                                         headers=auth_headers(self.secret)) as s:
            async with s.request(method, self.url + path, json=body) as r:
                r.raise_for_status()
                return await r.json()

    async def prefill(self, request_id: str, num_tokens: int, seed: int,
                      scatter: bool = False) -> KVSource:
        """Lease and fill blocks in the peer, as a prefill worker does; returns their KVSource."""
        return KVSource(**await self._call("POST", "/test/prefill", {
            "request_id": request_id, "num_tokens": num_tokens, "seed": seed, "scatter": scatter}))

    async def pull(self, request_id: str, source: KVSource, seed: int | None = None,
                   timeout_s: float = 30.0) -> dict[str, Any]:
        """Make the peer pull `source` as a decode worker does; returns KVPeer.pull's result."""
        return await self._call("POST", "/test/pull", {
            "request_id": request_id, "source": asdict(source), "seed": seed}, timeout_s)

    async def blocks(self) -> dict[str, Any]:
        return await self._call("GET", "/test/blocks")

    async def health(self) -> dict[str, Any]:
        return await self._call("GET", "/internal/kv/health")

    def stop(self, timeout_s: float = 10.0) -> None:
        super().stop(timeout_s)


async def prefill_and_decode(backend: str, layout: KVLayout, name: str, started: list, *,
                             secret: str | None = None, timeout_s: float = 5.0,
                             extra: dict[str, Any] | None = None) -> tuple[KVPeerProcess, KVPeer]:
    """A prefill peer process (appended to `started`, for the caller to kill) and a decode peer in
    this process (the caller closes it), sharing `secret`: the two ends of a guarded handoff."""
    prefill = KVPeerProcess(backend, layout, f"prefill-{name}", secret=secret, extra=extra)
    started.append(prefill)
    prefill.start()
    decode = KVPeer(backend, layout, f"decode-{name}-{os.getpid()}",
                    KVTransferConfig(backend=backend, timeout_s=timeout_s, secret=secret), fill=False)
    await decode.start()
    return prefill, decode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--backend", required=True)
    p.add_argument("--layout", required=True, help="KVLayout as JSON")
    p.add_argument("--engine-id", required=True)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--tcp-port", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=10.0)
    p.add_argument("--lease-s", type=float, default=30.0)
    p.add_argument("--no-fill", action="store_true")
    p.add_argument("--extra", default="{}", help="KVTransferConfig.extra as JSON")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    layout = KVLayout(**json.loads(a.layout))
    config = KVTransferConfig(backend=a.backend, timeout_s=a.timeout_s, lease_s=a.lease_s,
                              extra=json.loads(a.extra), port=a.tcp_port,
                              secret=os.environ.get(SECRET_ENV) or None)

    async def serve() -> None:
        peer = KVPeer(a.backend, layout, a.engine_id, config, fill=not a.no_fill)
        url = await peer.start(a.port)
        print("READY", url, flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            with contextlib.suppress(Exception):
                await peer.close()

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())

