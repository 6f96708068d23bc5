"""The KV transfer interface: one per worker process, registered once with the whole pool.

Direction is pull: the decode worker, once it has allocated destination
blocks, reads the prefill worker's blocks and then tells it they may be freed
(see the backends for how). Backends live beside this file and are chosen by
name through registry.py, so importing Tandem never requires nixl.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tandem.contracts.kv_health import KVHealth
from tandem.contracts.kv_layout import KVLayout
from tandem.contracts.protocol import KVSource

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
    timeout_s: float = 10.0  # a handoff that takes longer fails with TIMED_OUT
    lease_s: float = 30.0  # prefill side: blocks not pulled by then are reclaimed
    host: str = "127.0.0.1"  # address peers use to reach this worker (the pod IP in a cluster)
    extra: dict[str, Any] = field(default_factory=dict)  # backend options (UCX settings, ports)


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
        # Set by the prefill side's engine: called with a request id when a peer has
        # finished pulling that request's blocks, so they can be freed.
        self.on_released: Callable[[str], None] = lambda request_id: None

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

    @abc.abstractmethod
    async def pull(self, request_id: str, source: KVSource, local_block_ids: list[int]) -> TransferStats:
        """Decode side: copy source.block_ids of the remote pool into local_block_ids, then
        signal the prefill side. Raises KVTransferError within config.timeout_s on failure."""

    @abc.abstractmethod
    def health(self) -> KVHealth:
        """Served at /internal/kv/health: last success, failures, bandwidth, transport in use."""
