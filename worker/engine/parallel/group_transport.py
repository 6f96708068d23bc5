"""Rank 0's KV transport for a tensor-parallel worker: its own transport, plus the other ranks'.

To the rest of the worker it is one KVTransport (worker/kv/base.py): a KVSource it hands out names
every rank (`source_ranks`), under rank 0's lease; a pull it is asked for runs on every rank at
once, each rank reading the heads its pool holds straight from the source rank(s) that hold them
(rank 0 through its own transport, the others through their rank servers' /internal/rank/pull),
none releasing; once all have read, rank 0 releases the lease, which must still have been live.
A pull waits for every rank's answer (each bounds its own pull by timeout_s, and answers once
nothing writes into its blocks any more) for timeout_s and a margin; a rank that has not answered
by then, or when the pull is cancelled, is what still_writing() waits for: its blocks stay out of
use until it answers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

import aiohttp
from tandem.contracts.internal_auth import auth_headers
from tandem.contracts.kv_health import KVHealth
from tandem.contracts.kv_source import KVRank, KVSource
from tandem.contracts.protocol import REQUEST_ID_HEADER
from tandem.worker.kv.base import (
    KVTransferError,
    KVTransport,
    LeaseKeeper,
    TransferState,
    TransferStats,
)
from tandem.worker.kv.verify import Verdict

log = logging.getLogger("tandem.worker.engine.parallel")

_ANSWER_MARGIN_S = 5.0  # beyond a rank's own bound on its pull, for its answer to arrive


class GroupTransport(KVTransport):
    def __init__(self, local: Any, ranks: list[KVRank]):
        super().__init__(local.pool, local.layout, local.engine_id, local.config)
        self.local = local
        self.name = local.name
        self.ranks = ranks  # ranks 1.. of this worker, in order
        self._session: aiohttp.ClientSession | None = None
        self._landing: dict[str, list[asyncio.Future]] = {}  # request id -> rank pulls not answered yet
        self._verdicts: dict[str, list[tuple[Verdict, str]]] = {}  # request id -> the ranks' verdicts
        self.verify = True  # the ranks check what they pulled against the source's digests

    @property
    def leases(self) -> LeaseKeeper:  # type: ignore[override]
        return self.local.leases

    @leases.setter
    def leases(self, keeper: LeaseKeeper) -> None:
        if "local" in self.__dict__:  # KVTransport.__init__ sets a default before local exists
            self.local.leases = keeper

    async def start(self) -> None:
        """The local transport is started already; the ranks' are theirs."""

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        await self.local.close()

    def metadata(self) -> dict[str, Any]:
        return self.local.metadata()

    def source_extra(self) -> dict[str, Any]:
        return self.local.source_extra()

    def source_ranks(self) -> list[KVRank]:
        return list(self.ranks)

    def health(self) -> KVHealth:
        return self.local.health()

    def _post(self, rank: KVRank, path: str, body: dict, request_id: str) -> Any:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(headers=auth_headers(self.config.secret))
        return self._session.post(rank.url.rstrip("/") + path, json=body, headers={REQUEST_ID_HEADER: request_id})

    async def rank_digests(self, block_ids: list[int], algorithm: str) -> list[tuple[range, list[int]]]:
        """Every other rank's digests of its heads of these blocks, asked of all at once."""
        async def one(rank: KVRank) -> tuple[range, list[int]]:
            async with self._post(rank, "/internal/rank/digests", {"block_ids": block_ids, "algorithm": algorithm},
                                  "digests") as resp:
                doc = await resp.json()
            if resp.status != 200:
                raise KVTransferError(f"{rank.url} did not digest its KV heads: {doc}")
            return range(*doc["heads"]), doc["digests"]

        try:
            return list(await asyncio.wait_for(asyncio.gather(*(one(r) for r in self.ranks)), self.config.timeout_s))
        except (aiohttp.ClientError, OSError, ValueError, TimeoutError) as e:
            raise KVTransferError(f"a rank of this worker did not digest its KV heads: {e}") from e

    def rank_verdicts(self, request_id: str) -> list[tuple[Verdict, str]]:
        return self._verdicts.pop(request_id, [])

    def still_writing(self, request_id: str) -> asyncio.Future | None:
        """Rank 0's own transfers that may still land, and the ranks that have not answered yet (a
        rank answers once nothing writes into its blocks any more)."""
        pending = [f for f in self._landing.get(request_id, []) if not f.done()]
        own = self.local.still_writing(request_id)
        pending += [own] if own is not None else []
        return asyncio.ensure_future(asyncio.wait(pending)) if pending else None

    async def pull(self, request_id: str, source: KVSource, local_block_ids: list[int],
                   release: bool = True) -> TransferStats:
        timeout = self.config.timeout_s
        t0 = time.monotonic()
        own = asyncio.ensure_future(self.local.pull(request_id, source, local_block_ids, release=False))
        others = [asyncio.ensure_future(self._rank_pull(r, request_id, source, local_block_ids))
                  for r in self.ranks]
        try:  # each rank bounds its own pull by timeout_s; its answer gets a margin on top
            await asyncio.shield(asyncio.wait([own, *others], timeout=timeout + _ANSWER_MARGIN_S))
        except asyncio.CancelledError:
            own.cancel()  # rank 0's own pull stops its transfers before it returns
            self._keep_landing(request_id, others)
            raise
        self._keep_landing(request_id, others)
        results = [t.result() if t.done() and not t.cancelled() and t.exception() is None else
                   (t.exception() if t.done() and not t.cancelled() else
                    KVTransferError("no answer in time", TransferState.TIMED_OUT)) for t in (own, *others)]
        errors = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        if errors:
            rank, err = errors[0]
            if rank > 0:  # rank 0's own pull counted and reported its failure already
                await self.local._failed(request_id, source, set(), f"rank {rank}: {err}")
            state = err.state if isinstance(err, KVTransferError) else TransferState.FAILED
            raise KVTransferError(f"rank {rank} of this worker could not pull its KV heads: {err}", state)
        if release:
            try:
                await asyncio.wait_for(self.local._release_lease(request_id, source), timeout)
            except (KVTransferError, TimeoutError, aiohttp.ClientError, OSError, ValueError) as e:
                await self.local._failed(request_id, source, set(), str(e))
                raise KVTransferError(f"releasing the lease of {request_id}: {e}") from e
        if self.verify:  # kv_pull takes them once it checked rank 0's own heads
            self._verdicts[request_id] = [r.verdict for r in results[1:]]
        stats = [r for r in results if isinstance(r, TransferStats)]
        nbytes, seconds = sum(s.bytes for s in stats), time.monotonic() - t0
        if release:
            self.local.kv_health.success("pull", nbytes, seconds)  # the whole group's pull, once
        return TransferStats(request_id, nbytes, seconds, len(local_block_ids), sum(s.num_transfers for s in stats))

    def _keep_landing(self, request_id: str, rank_pulls: list[asyncio.Future]) -> None:
        """Ranks that have not answered may still write into the blocks: still_writing() waits for them."""
        pending = [t for t in rank_pulls if not t.done()]
        if pending:
            self._landing[request_id] = pending
            for t in pending:
                t.add_done_callback(lambda done, rid=request_id: self._forget_landed(rid, done))

    def _forget_landed(self, request_id: str, done: asyncio.Future) -> None:
        if not done.cancelled() and done.exception() is not None:  # the pull failed already; it has landed
            log.info("rank answered late for %s: %s", request_id, done.exception())
        if all(t.done() for t in self._landing.get(request_id, [])):
            self._landing.pop(request_id, None)

    async def _rank_pull(self, rank: KVRank, request_id: str, source: KVSource,
                         local_block_ids: list[int]) -> TransferStats:
        """One rank's pull (and its verdict on the heads it pulled); its answer comes once nothing
        writes into its blocks any more."""
        body = {"request_id": request_id, "source": dataclasses.asdict(source), "block_ids": local_block_ids,
                "verify": self.verify}
        try:
            async with self._post(rank, "/internal/rank/pull", body, request_id) as resp:
                doc = await resp.json()
        except (aiohttp.ClientError, OSError, ValueError) as e:  # the rank is gone: it writes nothing more
            raise KVTransferError(f"{rank.url} did not answer ({type(e).__name__}: {e})") from e
        if not doc.get("ok"):
            raise KVTransferError(str(doc.get("error") or doc), TransferState(doc.get("state") or "failed"))
        stats = RankPull(request_id, doc["bytes"], doc["seconds"], len(local_block_ids), doc["transfers"])
        stats.verdict = (Verdict(doc.get("verify", "off")), doc.get("verify_detail", ""))
        return stats


@dataclasses.dataclass
class RankPull(TransferStats):
    verdict: tuple[Verdict, str] = (Verdict.OFF, "")
