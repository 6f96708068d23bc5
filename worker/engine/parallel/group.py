"""A tensor-parallel group: one process per device, joined through the leader's (rank 0's) store.

torch.distributed underneath: NCCL for the tensors on CUDA and gloo on a CPU (so every test runs
here, one thread per rank), plus a gloo group for the small CPU-side messages (the step rank 0
broadcasts). Rank 0 hosts the rendezvous store (a TCPStore) at the leader address; the ranks also
publish their endpoints there. Joining waits `startup_s` (ranks load and compile at their own
pace); every collective afterwards waits `timeout_s` at most, so a rank that hangs fails the
others instead of holding them forever (a rank that dies fails them at once: its sockets close).

The collectives are torch's functional ones (`_c10d_functional`), which torch.compile traces into
the decode graph as it traces any other op; with one rank they are no-ops.
"""

from __future__ import annotations

import logging
import pickle
import struct
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("tandem.worker.engine.parallel")

_HEADER = 8192  # a step's message fits one broadcast of this many bytes; a larger one takes two
_LEN = struct.Struct("<Q")


class GroupFailed(RuntimeError):
    """The group cannot go on (a rank died, hung past the timeout, or left): the worker fails."""


@dataclass(frozen=True)
class GroupSpec:
    """How one rank joins: the group's size, its rank, where rank 0 listens, and the bounds."""

    size: int
    rank: int
    leader_host: str
    leader_port: int
    timeout_s: float = 60.0  # one collective at most, once serving
    startup_s: float = 900.0  # joining, and every rank's load and compile

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside a tensor-parallel group of {self.size}")


class ParallelGroup:
    """The process-group handle the parallel layers take: rank, size, device and collectives."""

    def __init__(self, spec: GroupSpec, device: torch.device, store: Any = None,
                 group: Any = None, cpu_group: Any = None):
        self.spec = spec
        self.rank, self.size = spec.rank, spec.size
        self.device = device
        self.store = store
        self.group = group  # tensors (nccl on CUDA, gloo on a CPU); None with one rank
        self.cpu_group = cpu_group  # small CPU messages (gloo)
        self.group_name = group.group_name if group is not None else ""

    @classmethod
    def single(cls, device: torch.device) -> ParallelGroup:
        """One rank, no process group: every collective is the identity."""
        return cls(GroupSpec(1, 0, "", 0), device)

    @classmethod
    def join(cls, spec: GroupSpec, device: torch.device, store: Any = None) -> ParallelGroup:
        """Rendezvous at the leader (rank 0 hosts the store; pass it when already made) and build
        the groups. Blocks until every rank has joined, `spec.startup_s` at most."""
        if spec.size == 1:
            return cls.single(device)
        if store is None:
            store = make_store(spec)
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, store=store, rank=spec.rank, world_size=spec.size,
                                timeout=timedelta(seconds=spec.startup_s))
        ranks = list(range(spec.size))
        # Start-up's collectives (compiling in step) wait as long as joining; serving() shortens it.
        startup = timedelta(seconds=spec.startup_s)
        group = dist.new_group(ranks, timeout=startup, backend=backend)
        cpu_group = group if backend == "gloo" else dist.new_group(ranks, timeout=startup, backend="gloo")
        log.info("joined the tensor-parallel group as rank %d of %d (%s, leader %s:%d)", spec.rank, spec.size,
                 backend, spec.leader_host, spec.leader_port)
        return cls(spec, device, store, group, cpu_group)

    def serving(self) -> None:
        """Start-up is over on this rank: from now on a collective waits timeout_s at most."""
        if self.size > 1:
            for g in {id(self.group): self.group, id(self.cpu_group): self.cpu_group}.values():
                dist.set_timeout(timedelta(seconds=self.spec.timeout_s), g)

    # --- collectives the layers use (traceable by torch.compile) --------------------------------

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of `t` over the ranks, on every rank."""
        if self.size == 1:
            return t
        out = torch.ops._c10d_functional.all_reduce(t, "sum", self.group_name)
        return torch.ops._c10d_functional.wait_tensor(out)

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' `t` concatenated along `dim`, rank order, on every rank."""
        if self.size == 1:
            return t
        out = torch.ops._c10d_functional.all_gather_into_tensor(t.contiguous(), self.size, self.group_name)
        out = torch.ops._c10d_functional.wait_tensor(out)  # [size * rows, ...]
        return torch.cat(out.chunk(self.size, dim=0), dim=dim)

    # --- messages (CPU) -------------------------------------------------------------------------

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank (pickled; the same code runs on every rank). GroupFailed
        when a rank has died or the wait passes the timeout."""
        try:
            if self.rank == 0:
                data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
                head = bytearray(_HEADER)
                head[:_LEN.size] = _LEN.pack(len(data))
                inline = len(data) <= _HEADER - _LEN.size
                if inline:
                    head[_LEN.size:_LEN.size + len(data)] = data
                dist.broadcast(torch.frombuffer(head, dtype=torch.uint8), 0, group=self.cpu_group)
                if not inline:
                    dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, group=self.cpu_group)
                return obj
            head_t = torch.empty(_HEADER, dtype=torch.uint8)
            dist.broadcast(head_t, 0, group=self.cpu_group)
            head = head_t.numpy().tobytes()
            (n,) = _LEN.unpack(head[:_LEN.size])
            if n <= _HEADER - _LEN.size:
                return pickle.loads(head[_LEN.size:_LEN.size + n])
            body = torch.empty(n, dtype=torch.uint8)
            dist.broadcast(body, 0, group=self.cpu_group)
            return pickle.loads(body.numpy().tobytes())
        except RuntimeError as e:  # gloo: a peer reset the connection, or the wait timed out
            raise GroupFailed(f"tensor-parallel group: {e}") from e

    # --- endpoints and readiness through the store (bounded by startup_s) -----------------------

    def publish(self, key: str, value: Any) -> None:
        self.store.set(f"tandem/{key}/{self.rank}", pickle.dumps(value))

    def gather_published(self, key: str, ranks: range | None = None, timeout_s: float | None = None) -> list[Any]:
        """The ranks' (default: every rank's) values for `key`, in rank order, waiting for the slowest."""
        keys = [f"tandem/{key}/{r}" for r in (range(self.size) if ranks is None else ranks)]
        try:
            self.store.wait(keys, timedelta(seconds=timeout_s or self.spec.startup_s))
        except RuntimeError as e:
            raise GroupFailed(f"ranks did not publish {key!r} within {timeout_s or self.spec.startup_s} s: "
                              f"{e}") from e
        return [pickle.loads(self.store.get(k)) for k in keys]

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - leaving a broken group is best effort
                log.debug("destroying the process group failed", exc_info=True)


def make_store(spec: GroupSpec) -> Any:
    """The rendezvous store: rank 0 listens at the leader address (port 0: a free one, which the
    store reports as `.port`), the others connect to it, within startup_s."""
    return dist.TCPStore(spec.leader_host, spec.leader_port, spec.size, is_master=spec.rank == 0,
                         timeout=timedelta(seconds=spec.startup_s), wait_for_workers=False)
