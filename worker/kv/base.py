"""The KV transfer interface: one per worker process, registered once with the whole pool.

Direction is pull: the decode worker, once it has allocated destination
blocks, reads the prefill worker's blocks and then tells it they may be freed
(see the backends for how). Backends live beside this file and are chosen by
name through registry.py, so importing Tandem never requires nixl.
"""

from __future__ import annotations

import abc
import asyncio
import enum
from collections.abc import Awaitable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from tandem.contracts import timing
from tandem.contracts.kv_health import KVHealth
from tandem.contracts.kv_layout import KVLayout
from tandem.contracts.kv_source import KVRank, KVSource

if TYPE_CHECKING:  # torch is only needed by the workers that hold a pool
    import torch


class TransferState(enum.StrEnum):
    PENDING = "pending"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"


class KVTransferError(RuntimeError):
    """A handoff failed (peer gone, transfer error, stale metadata); the caller frees its blocks."""

    def __init__(self, message: str, state: TransferState = TransferState.FAILED):
        super().__init__(message)
        self.state = state


@dataclass
class KVTransferConfig:
    backend: str = "nixl"  # "nixl" | "tcp" | "memory"
    timeout_s: float = timing.KV_TRANSFER_TIMEOUT_S  # a handoff that takes longer fails with TIMED_OUT
    lease_s: float = timing.KV_LEASE_S  # prefill side: blocks not pulled by then are reclaimed
    host: str = "127.0.0.1"  # address peers use to reach this worker (the pod IP in a cluster)
    extra: dict[str, Any] = field(default_factory=dict)  # backend options (UCX settings, limits)
    # The service's internal secret (tandem.contracts.internal_auth): sent on the HTTP calls to
    # peers and keying the tcp handshake. None: no checks (a worker warns at start-up).
    secret: str | None = field(default=None, repr=False)
    port: int = 0  # tcp: the port to serve KV on (0: any free one, for tests and laptops)
    serve: bool = True  # False on a decode-only worker: nobody reads from it, so open no port


class LeaseKeeper(Protocol):
    """What a transport asks the owner of the blocks (the engine, the test peer) before serving them.

    Every lease carries an unguessable token (KVSource.lease_token); a peer proves with it that
    the prefill result naming these blocks was handed to it."""

    def check_read(self, request_id: str, lease_token: str, block_ids: Collection[int]) -> bool | Awaitable[bool]:
        """True when request_id holds a live lease, lease_token is its token and every block is
        one of the lease's blocks (a subset: decode may pull only the blocks it lacks). A rank of a
        tensor-parallel group answers asynchronously: it asks its rank 0, which holds the leases."""
        ...

    def release_lease(self, request_id: str, lease_token: str) -> bool:
        """Free the lease's blocks when lease_token is its token; False (freeing nothing) when
        the token is wrong or the lease is gone (released already, or expired: then the blocks
        may have been reused and the puller must not trust what it read)."""
        ...


class NoLeases:
    """The keeper until an engine is attached: serves and frees nothing."""

    def check_read(self, request_id: str, lease_token: str, block_ids: Collection[int]) -> bool:
        return False

    def release_lease(self, request_id: str, lease_token: str) -> bool:
        return False


@dataclass
class TransferStats:
    request_id: str
    bytes: int
    seconds: float
    num_blocks: int
    num_transfers: int  # after merging adjacent blocks


class KVTransport(abc.ABC):
    """Moves whole KV blocks between the pools of two workers of compatible layout."""

    name: str = ""

    def __init__(self, pool: torch.Tensor, layout: KVLayout, engine_id: str, config: KVTransferConfig):
        self.pool = pool
        self.layout = layout
        self.engine_id = engine_id
        self.config = config
        # Set by the prefill side's owner of the pool (the engine): checks reads, frees blocks.
        self.leases: LeaseKeeper = NoLeases()

    @abc.abstractmethod
    async def start(self) -> None:
        """Register the pool with the transfer agent and open any listener."""

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    def metadata(self) -> dict[str, Any]:
        """JSON served at /internal/kv/metadata: backend, engine_id, layout, agent data."""

    def source_extra(self) -> dict[str, Any]:
        """Backend-specific fields a prefill result carries in KVSource.extra."""
        return {}

    def source_ranks(self) -> list[KVRank]:
        """A tensor-parallel worker's other ranks, which a KVSource it hands out carries."""
        return []

    async def rank_digests(self, block_ids: list[int], algorithm: str) -> list[tuple[range, list[int]]]:
        """A tensor-parallel worker's other ranks' digests of these blocks (worker/kv/verify.py):
        (the KV heads a rank holds, its digests). None here."""
        return []

    def rank_verdicts(self, request_id: str) -> list[tuple[Any, str]]:
        """After a pull of request_id: the other ranks' verdicts on the heads they pulled (verify.py
        Verdict and why), taken once. None here."""
        return []

    def still_writing(self, request_id: str) -> asyncio.Future | None:
        """After a failed pull of request_id: a transfer that may still write into its destination
        blocks (its abort has not returned within timeout_s), done once it has stopped; the caller
        keeps those blocks out of use until then. None: nothing writes there any more."""
        return None

    @abc.abstractmethod
    async def pull(self, request_id: str, source: KVSource, local_block_ids: list[int],
                   release: bool = True) -> TransferStats:
        """Decode side: copy source.block_ids of the remote pool into local_block_ids, then
        signal the prefill side (quoting source.lease_token). Raises KVTransferError within
        config.timeout_s on failure."""

    @abc.abstractmethod
    def health(self) -> KVHealth:
        """Served at /internal/kv/health: last success, failures, bandwidth, transport in use."""
