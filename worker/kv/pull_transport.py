"""What every pull-based backend shares: peer discovery, validation, the time bound and health.

Protocol (the same for every backend; why it is this way):

- PULL by the decode worker. It allocates destination blocks only when it has
  room, so backpressure lives where memory is scarce; the prefill worker needs
  to know nothing about decode ahead of time; the router just passes the
  KVSource from the prefill result to the decode worker.
- Metadata: GET <source.url>/internal/kv/metadata returns transport.metadata()
  (backend, engine_id "<pod>-<epoch>", layout, and the backend's addressing).
  The decode side caches it per URL. A KVSource whose engine_id differs from the
  cached one (a restarted peer) forces a fresh fetch and the old peer is
  forgotten (NIXL: remove_remote_agent; TCP: its connections closed); if the
  fresh metadata still names another engine_id the KV is gone and that is a
  KVTransferError. Any failed transfer also drops the cache, so stale metadata
  is never used twice. Peers no pull has used for kv_peer_idle_s, and the least
  recently used beyond kv_max_peers, are forgotten too (peer_table.py), so
  prefill churn never piles up sockets, NIXL agents or metadata here.
- Layout compatibility (KVLayout.compatible_with) and every block id are checked
  before a byte moves. Adjacent blocks that are adjacent on BOTH sides merge into
  one transfer (byte_ranges.py).
- Tensor parallelism: each rank pulls the KV heads its pool holds straight from the
  source rank(s) that hold them (KVSource.ranks, contracts/kv_layout.py pull_slices),
  a contiguous slice of each block; one lease, the source's rank 0's, covers every
  rank, and is released over HTTP once every rank has read (a released lease must
  have been live, so no rank read reused blocks).
- Trust: every HTTP call to a peer carries the service's internal secret
  (config.secret, `Authorization: Bearer`); the prefill side serves and frees only
  the blocks of a live lease proven by its token (source.lease_token), asking its
  LeaseKeeper (base.py). What each backend can check is in worker/kv/README.md.
- Completion: the backend signals the prefill side with the lease token, which
  calls leases.release_lease(request_id, token) so the engine frees the blocks.
- Failure: a dead peer, a transfer error or config.timeout_s elapsing raises
  KVTransferError on the decode side (its caller frees the destination blocks)
  and, where the peer is still reachable, POSTs /internal/kv/release so the
  prefill side frees at once; otherwise the prefill engine reclaims by lease.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import aiohttp
from tandem.contracts.internal_auth import auth_headers
from tandem.contracts.kv_health import KVHealth, TransportInfo
from tandem.contracts.kv_layout import HeadSlice, KVLayout, pull_slices
from tandem.contracts.kv_source import KVRank, KVSource
from tandem.contracts.protocol import REQUEST_ID_HEADER
from tandem.worker.kv.base import (
    KVTransferConfig,
    KVTransferError,
    KVTransport,
    TransferState,
    TransferStats,
)
from tandem.worker.kv.byte_ranges import Range, head_ranges
from tandem.worker.kv.health import TransferHealth
from tandem.worker.kv.peer_table import MAX_PEERS, PEER_IDLE_S, PeerTable

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def pool_bytes(pool: torch.Tensor) -> memoryview:
    """A writable byte view of the pool's storage (no copy), for sockets to send from and recv into."""
    import torch

    if pool.device.type != "cpu":
        raise ValueError("the tcp backend moves host memory; use nixl for a GPU pool")
    if not pool.is_contiguous():
        raise ValueError("the KV pool must be one contiguous tensor")
    return memoryview(pool.view(torch.uint8).reshape(-1).numpy()).cast("B")


class PullTransport(KVTransport):
    """KVTransport with the decode-side bookkeeping done once; backends move the bytes."""

    def __init__(self, pool: torch.Tensor, layout: KVLayout, engine_id: str,
                 config: KVTransferConfig):
        super().__init__(pool, layout, engine_id, config)
        if tuple(pool.shape) != layout.shape:
            raise ValueError(f"pool shape {tuple(pool.shape)} does not match the layout {layout.shape}")
        self.kv_health = TransferHealth(self.name, engine_id,
                                        config.extra.get("kv_metrics"),
                                        self._transport_info())
        # url -> metadata of the engine last seen there; bounded (peer_table.py)
        self._peers = PeerTable(float(config.extra.get("kv_peer_idle_s", PEER_IDLE_S)),
                                int(config.extra.get("kv_max_peers", MAX_PEERS)))
        self._background: set[asyncio.Task] = set()
        self._landing: dict[str, list[asyncio.Future]] = {}  # request id -> transfers that may still write
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    # --- backend hooks ------------------------------------------------------------------------

    def _transport_info(self) -> TransportInfo:
        """What carries the bytes (RDMA or TCP) and how that was found out, for health()."""
        return TransportInfo(rdma=False, network=self.name,
                             detected_by=f"the {self.name} backend never uses RDMA")

    @abc.abstractmethod
    async def _add_peer(self, md: dict[str, Any]) -> None:
        """Make a freshly fetched peer reachable (NIXL: add_remote_agent)."""

    @abc.abstractmethod
    async def _forget_peer(self, md: dict[str, Any]) -> None:
        """Drop everything known about a peer (restarted, failed or closing)."""

    @abc.abstractmethod
    async def _read(self, md: dict[str, Any], request_id: str, lease_token: str, ranges: list[Range],
                    release: bool) -> int:
        """Copy the byte ranges (byte_ranges.py) from the peer's pool into ours and, with
        `release`, signal completion, which ends the lease (quoting its token); returns transfers
        made. Must leave nothing writing into our pool when it returns, raises or is cancelled."""

    # --- shared -------------------------------------------------------------------------------

    def still_writing(self, request_id: str) -> asyncio.Future | None:
        pending = [f for f in self._landing.get(request_id, []) if not f.done()]
        return asyncio.ensure_future(asyncio.wait(pending)) if pending else None

    def _writing(self, request_id: str, transfer: asyncio.Future) -> None:
        """A backend's transfer for request_id that may still write into this pool until it is done."""
        self._landing.setdefault(request_id, []).append(transfer)

        def landed(_: asyncio.Future) -> None:
            left = [f for f in self._landing.get(request_id, []) if f is not transfer]
            if left:
                self._landing[request_id] = left
            else:
                self._landing.pop(request_id, None)

        transfer.add_done_callback(landed)

    def _base_metadata(self) -> dict[str, Any]:
        return {"backend": self.name, "engine_id": self.engine_id, "layout": self.layout.to_dict()}

    def health(self) -> KVHealth:
        return self.kv_health.report(peers={u: m["engine_id"] for u, m in self._peers.items()})

    async def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(headers=auth_headers(self.config.secret))
        return self._session

    async def _close_shared(self) -> None:
        self._closed = True
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        for url, md in self._peers.items():
            self._peers.pop(url)
            await self._forget_peer(md)
        if self._session is not None:
            await self._session.close()

    async def _peer(self, source: KVRank) -> dict[str, Any]:
        """The metadata of the engine that holds source's blocks: cached, or fetched if it restarted.
        Peers gone quiet are forgotten first, so prefill churn leaves nothing behind here."""
        await self._forget_stale_peers()
        cached = self._peers.get(source.url)
        if cached is not None and cached["engine_id"] == source.engine_id:
            return cached
        # One discovery per URL at a time: concurrent pulls from a restarted peer must not
        # forget the successor another pull has just added.
        async with self._peers.lock(source.url):
            return await self._discover(source)

    async def _discover(self, source: KVRank) -> dict[str, Any]:
        cached = self._peers.get(source.url)
        if cached is not None and cached["engine_id"] == source.engine_id:
            return cached
        md = await self._fetch(source)
        if cached is not None:
            if cached["engine_id"] == md["engine_id"]:  # the source is stale, the peer is not
                raise KVTransferError(
                    f"the prefill worker at {source.url} is {md['engine_id']}, but the KV was "
                    f"computed by {source.engine_id} (gone): re-run prefill")
            # Restarted: forget the predecessor (its transfers fail anyway; it is gone).
            log.info("kv peer at %s is now %s (was %s): using fresh metadata",
                     source.url, md["engine_id"], cached["engine_id"])
            await self._drop_peer(source.url)
        if md["engine_id"] != source.engine_id:
            raise KVTransferError(
                f"the prefill worker at {source.url} is now {md['engine_id']}, but the KV was "
                f"computed by {source.engine_id} (it restarted and its blocks are gone): re-run prefill")
        await self._add_peer(md)
        self._peers.put(source.url, md)
        await self._forget_stale_peers()  # the newcomer (in use) may push the least recent out
        return md

    async def _forget_stale_peers(self) -> None:
        for url in self._peers.stale():
            await self._drop_peer(url)

    async def _fetch(self, source: KVRank) -> dict[str, Any]:
        """GET the peer's metadata and check it can serve us at all (backend, layout)."""
        session = await self._http()
        try:
            async with session.get(source.url.rstrip("/") + "/internal/kv/metadata") as resp:
                if resp.status == 401:
                    raise KVTransferError(
                        f"{source.url} refused this worker's internal secret (401): every worker "
                        "of a service must run with the same secret (TANDEM_INTERNAL_SECRET)")
                if resp.status != 200:
                    raise KVTransferError(f"{source.url}/internal/kv/metadata answered {resp.status}")
                md = await resp.json()
        except (aiohttp.ClientError, OSError, ValueError) as e:
            raise KVTransferError(f"cannot fetch KV metadata from {source.url}: {e}") from e
        if md.get("backend") != self.name:
            raise KVTransferError(f"peer {source.engine_id} uses KV backend {md.get('backend')!r}, "
                                  f"this worker {self.name!r}: configure both roles alike")
        remote = KVLayout(**md["layout"])
        if not self.layout.compatible_with(remote):
            raise KVTransferError(f"KV layouts differ: peer {remote}, here {self.layout}: "
                                  "prefill and decode must serve the same model and dtype")
        return md

    async def _drop_peer(self, url: str) -> None:
        md = self._peers.pop(url)
        if md is not None:
            try:
                await self._forget_peer(md)
            except Exception:  # forgetting is best effort; never mask the error being handled
                log.exception("forgetting kv peer %s failed", md.get("engine_id"))

    def _check(self, source: KVSource, local_block_ids: list[int], md: dict[str, Any]) -> None:
        if len(source.block_ids) != len(local_block_ids):
            raise KVTransferError(f"{len(source.block_ids)} source blocks but "
                                  f"{len(local_block_ids)} destination blocks")
        if len(source.block_ids) < self.layout.blocks_for(source.num_tokens):
            raise KVTransferError(f"{source.num_tokens} tokens need "
                                  f"{self.layout.blocks_for(source.num_tokens)} blocks, "
                                  f"the source lists {len(source.block_ids)}")
        remote_blocks = md["layout"]["num_blocks"]
        if any(not 0 <= b < remote_blocks for b in source.block_ids):
            raise KVTransferError(f"source block ids outside the peer's pool of {remote_blocks}")
        if any(not 0 <= b < self.layout.num_blocks for b in local_block_ids):
            raise KVTransferError(f"destination block ids outside this pool of {self.layout.num_blocks}")

    def slices(self, source: KVSource) -> dict[int, list[HeadSlice]]:
        """Source rank -> the head slices this pool reads from it (tandem.contracts.kv_layout)."""
        by_rank: dict[int, list[HeadSlice]] = {}
        for s in pull_slices(self.layout.num_kv_heads, source.tensor_parallel, self.layout.tp_size,
                           self.layout.tp_rank):
            by_rank.setdefault(s.source_rank, []).append(s)
        return by_rank

    async def pull(self, request_id: str, source: KVSource, local_block_ids: list[int],
                   release: bool = True) -> TransferStats:
        """Read this pool's KV heads of source's blocks from the source rank(s) that hold them.
        One rank on each side: the read itself ends the lease (the original protocol). Otherwise
        every source rank is read at once without releasing, and then, with `release`, the lease
        (rank 0's, covering every rank) is released and must still have been live: a rank of a
        tensor-parallel decode worker pulls with release=False and its rank 0 releases once every
        rank is done (parallel/group_transport.py)."""
        t0 = time.monotonic()
        in_band = release and source.tensor_parallel == 1 and self.layout.tp_size == 1
        moving: set[int] = set()  # source ranks read from when it failed: forget those peers
        try:
            if source.tensor_parallel > 1 and source.backend != self.name:
                raise KVTransferError(f"source backend {source.backend!r}, this worker {self.name!r}")
            async with asyncio.timeout(self.config.timeout_s):
                reads = [self._read_rank(request_id, source, r, slices, local_block_ids, in_band, moving)
                         for r, slices in self.slices(source).items()]
                done = await all_or_none(reads)
                if release and not in_band:
                    await self._release_lease(request_id, source)
        except TimeoutError:
            err = KVTransferError(f"KV handoff of {request_id} from {source.url} took longer than "
                                  f"{self.config.timeout_s} s", TransferState.TIMED_OUT)
            await self._failed(request_id, source, moving, str(err))
            raise err from None
        except KVTransferError as e:
            await self._failed(request_id, source, moving, str(e))
            raise
        except (OSError, aiohttp.ClientError, asyncio.IncompleteReadError, ValueError) as e:
            await self._failed(request_id, source, moving, f"{type(e).__name__}: {e}")
            raise KVTransferError(f"KV handoff of {request_id} from {source.url} failed: "
                                  f"{type(e).__name__}: {e}") from e
        except asyncio.CancelledError:
            await self._failed(request_id, source, set(), "cancelled")  # others may share the peer
            raise
        seconds = time.monotonic() - t0
        nbytes = sum(n for n, _ in done)
        if release:  # else one rank's share: its group's rank 0 counts the whole pull (group_transport.py)
            self.kv_health.success("pull", nbytes, seconds)
        return TransferStats(request_id, nbytes, seconds, len(local_block_ids), sum(t for _, t in done))

    async def _read_rank(self, request_id: str, source: KVSource, rank: int, slices: list[HeadSlice],
                         local_block_ids: list[int], release: bool, moving: set[int]) -> tuple[int, int]:
        """(bytes, transfers) read from one rank of the source."""
        endpoint = source.rank(rank)
        with self._peers.using(endpoint.url):  # not forgotten while this pull needs it
            md = await self._peer(endpoint)
            self._check(source, local_block_ids, md)
            remote = KVLayout(**md["layout"])
            ranges = [r for s in slices
                      for r in head_ranges(remote, self.layout, s, source.block_ids, local_block_ids)]
            if not ranges:
                return 0, 0
            moving.add(rank)
            return sum(n for _, _, n in ranges), await self._read(md, request_id, source.lease_token, ranges,
                                                                  release)

    async def _release_lease(self, request_id: str, source: KVSource) -> None:
        """End the lease at the source's rank 0 now that every rank has read; it must have been live
        (else its blocks may have been reused while they were read)."""
        session = await self._http()
        async with session.post(source.url.rstrip("/") + "/internal/kv/release",
                                json={"request_id": request_id, "lease_token": source.lease_token},
                                headers={REQUEST_ID_HEADER: request_id}) as resp:
            doc = await resp.json() if resp.status == 200 else {}
        if not doc.get("released"):
            raise KVTransferError(f"the lease of {request_id} at {source.url} was not live when every rank "
                                  "had read (expired or released): re-run prefill")

    async def _failed(self, request_id: str, source: KVSource, moving: set[int], error: str) -> None:
        """Count the failure, forget the peers that failed mid-transfer (so their metadata is
        fetched afresh next time) and ask the source to free the request's blocks if it still
        listens."""
        self.kv_health.failure("pull", error)
        log.warning("kv pull of %s from %s failed: %s", request_id, source.url, error)
        for r in moving:
            endpoint = source.rank(r)
            cached = self._peers.get(endpoint.url)
            if cached is not None and cached["engine_id"] == endpoint.engine_id:
                await self._drop_peer(endpoint.url)
        if self._closed:
            return
        # The release is best effort and bounded: a dead peer's engine reclaims by lease.
        task = asyncio.get_running_loop().create_task(self._post_release(request_id, source))
        self._background.add(task)  # held until done, so it is not garbage-collected mid-flight
        task.add_done_callback(self._background.discard)

    async def _post_release(self, request_id: str, source: KVSource) -> None:
        try:
            session = await self._http()
            async with asyncio.timeout(2.0), session.post(
                    source.url.rstrip("/") + "/internal/kv/release",
                    json={"request_id": request_id, "lease_token": source.lease_token},
                    headers={REQUEST_ID_HEADER: request_id}) as resp:
                await resp.read()
        except (TimeoutError, aiohttp.ClientError, OSError):
            pass


async def all_or_none(coros: list[Any]) -> list[Any]:
    """Every coroutine's result; when one raises, the rest are cancelled and awaited (none may
    still write into the pool) before its exception is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    if not tasks:
        return []
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for t in tasks:
        if not t.cancelled() and t.exception() is not None:
            raise t.exception()
    return [t.result() for t in tasks]
