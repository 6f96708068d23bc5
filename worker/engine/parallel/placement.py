"""Where a worker process sits in its tensor-parallel group: pure, from flags and LeaderWorkerSet's env.

A group of N ranks runs one process per rank. On one node (a laptop, or one pod with N devices)
the worker that is started is rank 0 and starts ranks 1..N-1 itself, with the rendezvous on a free
loopback port. A group spanning nodes is one pod per node (a LeaderWorkerSet: LWS sets
LWS_LEADER_ADDRESS, LWS_GROUP_SIZE and LWS_WORKER_INDEX in every pod): each pod's process is
the first rank of its node, rank LWS_WORKER_INDEX * N / LWS_GROUP_SIZE, and starts the other
ranks of its node; all meet at the leader's address, port RENDEZVOUS_PORT. Flags win over the
environment: `--tensor-parallel N --rank K --leader-address HOST:PORT [--local-ranks L]`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tandem.contracts.names import (
    LWS_GROUP_SIZE_ENV,
    LWS_LEADER_ADDRESS_ENV,
    LWS_WORKER_INDEX_ENV,
    RENDEZVOUS_PORT,
)


@dataclass(frozen=True)
class Placement:
    size: int  # ranks in the group
    rank: int  # this process's rank
    local_ranks: int  # ranks this process runs: itself and local_ranks - 1 it starts
    leader_host: str
    leader_port: int  # 0: a local group, rank 0 picks a free port and tells the ranks it starts

    @property
    def spans_nodes(self) -> bool:
        return self.local_ranks < self.size

    @property
    def started_ranks(self) -> range:
        """The ranks this process starts as processes of its own."""
        return range(self.rank + 1, self.rank + self.local_ranks)


def split_address(address: str) -> tuple[str, int]:
    """HOST:PORT (or [v6]:PORT, or HOST alone: the rendezvous port)."""
    host, sep, port = address.rpartition(":")
    if not sep or "]" in port or (host.count(":") and not host.startswith("[")):
        return address.strip("[]"), RENDEZVOUS_PORT
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"leader address {address!r}: the port must be a number from 1 to 65535")
    return host.strip("[]"), int(port)


def _env_int(env: Mapping[str, str], key: str) -> int | None:
    raw = env.get(key)
    if raw in (None, ""):
        return None
    if not raw.isdigit():
        raise ValueError(f"${key} must be a non-negative integer, got {raw!r}")
    return int(raw)


def place(size: int, rank: int | None, local_ranks: int | None, leader_address: str | None,
          env: Mapping[str, str]) -> Placement:
    """This process's place in the group; ValueError for an inconsistent one (naming the numbers)."""
    if size < 1:
        raise ValueError(f"tensor_parallel must be >= 1, got {size}")
    if size == 1:
        return Placement(1, 0, 1, "127.0.0.1", 0)
    address = leader_address or env.get(LWS_LEADER_ADDRESS_ENV) or None
    pods, index = _env_int(env, LWS_GROUP_SIZE_ENV), _env_int(env, LWS_WORKER_INDEX_ENV)
    if address is None:  # one node: this is rank 0 and starts the rest
        if rank not in (None, 0) or local_ranks not in (None, size):
            raise ValueError(f"rank {rank} of a group of {size} needs --leader-address (or "
                             f"${LWS_LEADER_ADDRESS_ENV}): the address where rank 0 listens")
        return Placement(size, 0, size, "127.0.0.1", 0)
    if local_ranks is None:
        if pods and size % pods:
            raise ValueError(f"${LWS_GROUP_SIZE_ENV}={pods} pods cannot hold a tensor-parallel group of {size} "
                             "ranks evenly")
        local_ranks = size // pods if pods else 1
    if local_ranks < 1 or size % local_ranks:
        raise ValueError(f"{local_ranks} ranks per node do not divide a tensor-parallel group of {size}"
                         + (f" (${LWS_GROUP_SIZE_ENV}={pods} pods)" if pods else ""))
    if rank is None:
        rank = (index or 0) * local_ranks
    if not 0 <= rank < size or rank % local_ranks:
        raise ValueError(f"rank {rank} is not the first of {local_ranks} ranks of a node in a group of {size}")
    host, port = split_address(address)
    return Placement(size, rank, local_ranks, host, port)
