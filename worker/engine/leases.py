"""KV leases (prefill role): a prefilled sequence's blocks kept for a decode worker to pull.

A lease is keyed by request id and proven by a token handed out with the prefill result; reads,
releases and aborts must quote it. Mixed into `Engine`, whose lock, allocator and wake-up hook it
uses; the engine is the transports' LeaseKeeper (worker/kv/base.py).
"""

from __future__ import annotations

import hmac
import logging
import secrets
import time
from collections.abc import Collection
from dataclasses import dataclass, field

from tandem.worker.engine.block_allocator import BlockAllocator
from tandem.worker.engine.prefix_cache import PublishingLock
from tandem.worker.engine.request_state import RequestState
from tandem.worker.engine.scheduler import Scheduler
from tandem.worker.engine.sequence import Sequence

log = logging.getLogger("tandem.worker.engine")


@dataclass
class Lease:
    seq: Sequence
    expires: float  # time.monotonic()
    # Handed out with the prefill result (KVSource.lease_token); reads and releases must quote it.
    token: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)


def _same_token(expected: str, given: str) -> bool:
    """Constant-time token comparison (a wrong token must not tell how much of it was right)."""
    return isinstance(given, str) and hmac.compare_digest(expected.encode(), given.encode())


class LeaseKeeping:
    """The lease half of the engine (attributes set by Engine.__init__)."""

    lock: PublishingLock
    allocator: BlockAllocator
    scheduler: Scheduler
    leases: dict[str, Lease]
    lease_s: float

    def _lease(self, seq: Sequence, state: RequestState) -> None:
        """Under the lock: seq's blocks now wait for a peer to pull them (LEASED or MIGRATING)."""
        seq.status = state
        self.leases[seq.request_id] = Lease(seq, time.monotonic() + self.lease_s)

    def release_lease(self, request_id: str, lease_token: str) -> bool:
        """LeaseKeeper: a peer is done with a lease whose token it quoted (pulled, released or given
        up): its blocks are freed; False, freeing nothing, for a wrong token or a lease gone."""
        return self._end_lease(request_id, lease_token)

    def check_read(self, request_id: str, lease_token: str, block_ids: Collection[int]) -> bool:
        """LeaseKeeper: whether a peer may read these blocks: a live lease of request_id, proven
        by its token, holds every one of them."""
        with self.lock:
            lease = self.leases.get(request_id)
            return (lease is not None and _same_token(lease.token, lease_token)
                    and lease.expires > time.monotonic() and set(block_ids) <= set(lease.seq.block_table))

    def lease_token(self, request_id: str) -> str | None:
        """The token of request_id's live lease, to hand out with its prefill result."""
        with self.lock:
            lease = self.leases.get(request_id)
            return None if lease is None else lease.token

    def _end_lease(self, request_id: str, lease_token: str | None) -> bool:
        """LEASED/MIGRATING -> FINISHED, its blocks freed, when lease_token is its token (None: an
        in-process caller, i.e. the expiry)."""
        with self.lock:
            lease = self.leases.get(request_id)
            if lease is None or (lease_token is not None and not _same_token(lease.token, lease_token)):
                return False
            del self.leases[request_id]
            self.scheduler.free_blocks(lease.seq)
            lease.seq.status = RequestState.FINISHED
        return True

    def expire_leases(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        with self.lock:
            expired = [rid for rid, lease in self.leases.items() if lease.expires <= now]
        for rid in expired:
            log.warning("KV lease expired before a peer pulled it", extra={"request_id": rid})
            self._end_lease(rid, None)
        return expired

    def next_lease_expiry(self) -> float | None:
        with self.lock:
            return min((lease.expires for lease in self.leases.values()), default=None)
