"""The lease table: blocks a request keeps for another worker to pull (a prefill result: LEASED; a
draining decode worker's sequence: MIGRATING), keyed by request id, proven by a token, bounded in time.

A lease's token goes out only with the KVSource naming its blocks (to the router and the worker it
picks); reading the blocks, releasing them, or aborting the request that holds them must quote it.
The table holds no lock, frees no block and writes no state: the request table (request_table.py)
calls it under the engine's lock and moves the sequence, and the engine gives the blocks of a lease
taken out back to the pool (engine.py), as it does with the block allocator.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field

from tandem.worker.engine.sequence import EngineSequence


@dataclass
class Lease:
    seq: EngineSequence
    expires: float  # time.monotonic()
    # Handed out with the KVSource (KVSource.lease_token); reads and releases must quote it.
    token: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)


def same_token(expected: str, given: object) -> bool:
    """Constant-time token comparison (a wrong token must not tell how much of it was right)."""
    return isinstance(given, str) and hmac.compare_digest(expected.encode(), given.encode())


class LeaseTable:
    """Leases by request id: what each holds, its token and when it expires (see the module docstring)."""

    def __init__(self, lease_s: float):
        if lease_s < 0:
            raise ValueError(f"lease_s must be >= 0 (0: a lease ends at its first expiry check), got {lease_s}")
        self.lease_s = lease_s
        self._leases: dict[str, Lease] = {}

    def add(self, seq: EngineSequence, now: float | None = None) -> Lease:
        """seq's blocks now wait for a peer, until lease_s from now (the request table moves it to
        LEASED or MIGRATING)."""
        if seq.request_id in self._leases:
            raise ValueError(f"request {seq.request_id!r} holds a lease already")
        lease = Lease(seq, (time.monotonic() if now is None else now) + self.lease_s)
        self._leases[seq.request_id] = lease
        return lease

    def token(self, request_id: str) -> str | None:
        lease = self._leases.get(request_id)
        return None if lease is None else lease.token

    def may_read(self, request_id: str, token: str, block_ids: Collection[int], now: float | None = None) -> bool:
        """A live lease of request_id, proven by its token, holds every one of these blocks."""
        lease = self._leases.get(request_id)
        now = time.monotonic() if now is None else now
        return (lease is not None and same_token(lease.token, token) and lease.expires > now
                and set(block_ids) <= set(lease.seq.block_table))

    def take(self, request_id: str, token: str | None) -> Lease | None:
        """Take a lease out when `token` is its token (None: the owner itself, e.g. its expiry); its
        blocks are the caller's to free. None, taking nothing, for a wrong token or no lease."""
        lease = self._leases.get(request_id)
        if lease is None or (token is not None and not same_token(lease.token, token)):
            return None
        del self._leases[request_id]
        return lease

    def expired(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        return [rid for rid, lease in self._leases.items() if lease.expires <= now]

    def next_expiry(self) -> float | None:
        return min((lease.expires for lease in self._leases.values()), default=None)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._leases

    def __getitem__(self, request_id: str) -> Lease:
        return self._leases[request_id]

    def __len__(self) -> int:
        return len(self._leases)

    def __iter__(self) -> Iterator[str]:
        return iter(self._leases)

    def values(self) -> list[Lease]:
        return list(self._leases.values())
