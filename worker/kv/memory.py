"""The in-memory backend: prefill and decode transports in one process, for unit tests of the engine.

Transports register in a process-wide table (engine_id -> transport) on
start() and leave it on close(); a pull asks the source's LeaseKeeper to check
the read, copies block runs tensor to tensor and releases the lease with its
token. It follows the same protocol as the real backends (pull, engine_id,
layout and lease checked, runs merged), but finds peers by engine_id instead of
over HTTP, so no server is needed.
"""

from __future__ import annotations

from typing import Any

import torch
from tandem.contracts.kv_layout import KVLayout
from tandem.contracts.kv_source import KVRank, KVSource
from tandem.worker.kv.base import KVTransferError
from tandem.worker.kv.byte_ranges import Range, blocks_touched
from tandem.worker.kv.pull_transport import PullTransport

ENGINES: dict[str, MemoryTransport] = {}


class MemoryTransport(PullTransport):
    """Copies blocks between pools of the same process."""

    name = "memory"

    async def start(self) -> None:
        if ENGINES.get(self.engine_id) not in (None, self):
            raise ValueError(f"engine_id {self.engine_id} is already registered in this process")
        ENGINES[self.engine_id] = self

    async def close(self) -> None:
        if ENGINES.get(self.engine_id) is self:
            del ENGINES[self.engine_id]
        await self._close_shared()

    def metadata(self) -> dict[str, Any]:
        return self._base_metadata()

    async def _peer(self, source: KVRank) -> dict[str, Any]:
        peer = ENGINES.get(source.engine_id)
        if peer is None:
            raise KVTransferError(f"no engine {source.engine_id} in this process (stopped or restarted)")
        if not self.layout.compatible_with(KVLayout(**peer.metadata()["layout"])):
            raise KVTransferError(f"KV layouts differ: peer {peer.layout}, here {self.layout}")
        return peer.metadata()

    async def _add_peer(self, md: dict[str, Any]) -> None:
        pass

    async def _forget_peer(self, md: dict[str, Any]) -> None:
        pass

    async def _post_release(self, request_id: str, source: KVSource) -> None:
        peer = ENGINES.get(source.engine_id)
        if peer is not None:
            peer.leases.release_lease(request_id, source.lease_token)

    async def _release_lease(self, request_id: str, source: KVSource) -> None:
        peer = ENGINES.get(source.engine_id)
        if peer is None or not peer.leases.release_lease(request_id, source.lease_token):
            raise KVTransferError(f"the lease of {request_id} was not live when every rank had read")

    async def _read(self, md: dict[str, Any], request_id: str, lease_token: str, ranges: list[Range],
                    release: bool) -> int:
        peer = ENGINES.get(md["engine_id"])
        if peer is None:
            raise KVTransferError(f"engine {md['engine_id']} stopped during the handoff")
        bb = peer.layout.block_bytes
        blocks = sorted({b for s, _, n in ranges for b in blocks_touched(s, n, bb)})
        if not peer.leases.check_read(request_id, lease_token, blocks):
            raise KVTransferError(f"peer {md['engine_id']} refused: no live lease of {request_id} "
                                  "with that token holds these blocks")
        here, there = self.pool.view(-1).view(torch.uint8), peer.pool.view(-1).view(torch.uint8)
        for s, d, n in ranges:
            here[d:d + n].copy_(there[s:s + n])
        peer.kv_health.success("serve", sum(n for _, _, n in ranges))
        if release and not peer.leases.release_lease(request_id, lease_token):
            raise KVTransferError("the lease on these blocks expired before the pull finished")
        return len(ranges)
