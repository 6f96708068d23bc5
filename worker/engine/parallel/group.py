"""A tensor-parallel group: one process per device, joined through the leader's (rank 0's) store.

torch.distributed underneath: NCCL for the tensors on CUDA and gloo on a CPU (so every test runs
here, one thread per rank), plus a gloo group for the small CPU-side messages (the step rank 0
broadcasts). Rank 0 hosts the rendezvous store (a TCPStore) listening on the leader address alone;
the ranks also publish their endpoints there. Everything this module carries between ranks is sealed
JSON (wire.py), never pickle. Joining waits `startup_s` (ranks load and compile at their own
pace); every collective afterwards waits `timeout_s` at most, so a rank that hangs fails the
others instead of holding them forever (a rank that dies fails them at once: its sockets close).

The collectives are torch's functional ones (`_c10d_functional`), which torch.compile traces into
the decode graph as it traces any other op; with one rank they are no-ops.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from tandem.worker.engine.parallel.wire import SealBroken, from_fields, seal, unseal

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
    secret: str | None = field(default=None, repr=False)  # the service's internal secret: seals values

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

    def broadcast(self, value: Any = None) -> Any:
        """Rank 0's JSON-able `value` on every rank (sealed: wire.py). GroupFailed when a rank has
        died, the wait passes the timeout, or what arrived is not sealed with the group's secret."""
        try:
            if self.rank == 0:
                data = seal(value, self.spec.secret)
                head = bytearray(_HEADER)
                head[:_LEN.size] = _LEN.pack(len(data))
                inline = len(data) <= _HEADER - _LEN.size
                if inline:
                    head[_LEN.size:_LEN.size + len(data)] = data
                dist.broadcast(torch.frombuffer(head, dtype=torch.uint8), 0, group=self.cpu_group)
                if not inline:
                    dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, group=self.cpu_group)
                return value
            head_t = torch.empty(_HEADER, dtype=torch.uint8)
            dist.broadcast(head_t, 0, group=self.cpu_group)
            head = head_t.numpy().tobytes()
            (n,) = _LEN.unpack(head[:_LEN.size])
            if n <= _HEADER - _LEN.size:
                return unseal(head[_LEN.size:_LEN.size + n], self.spec.secret, "a step from rank 0")
            body = torch.empty(n, dtype=torch.uint8)
            dist.broadcast(body, 0, group=self.cpu_group)
            return unseal(body.numpy().tobytes(), self.spec.secret, "a step from rank 0")
        except (RuntimeError, SealBroken) as e:  # gloo: a peer reset the connection, or the wait timed out
            raise GroupFailed(f"tensor-parallel group: {e}") from e

    # --- endpoints and readiness through the store (bounded by startup_s) -----------------------

    def publish(self, key: str, value: Any) -> None:
        """This rank's `value` (a dataclass or JSON-able) under `key`, sealed."""
        self.store.set(f"tandem/{key}/{self.rank}", seal(value, self.spec.secret))

    def gather_published(self, key: str, cls: type, ranks: range | None = None,
                         timeout_s: float | None = None) -> list[Any]:
        """The ranks' (default: every rank's) values for `key` as `cls` dataclasses, in rank order,
        waiting for the slowest. GroupFailed for a value not sealed with the group's secret."""
        ranks = range(self.size) if ranks is None else ranks
        keys = [f"tandem/{key}/{r}" for r in ranks]
        try:
            self.store.wait(keys, timedelta(seconds=timeout_s or self.spec.startup_s))
        except RuntimeError as e:
            raise GroupFailed(f"ranks did not publish {key!r} within {timeout_s or self.spec.startup_s} s: "
                              f"{e}") from e
        try:
            return [from_fields(cls, unseal(self.store.get(k), self.spec.secret, f"{key!r} of rank {r}"),
                                f"{key!r} of rank {r}") for k, r in zip(keys, ranks, strict=True)]
        except SealBroken as e:
            raise GroupFailed(f"tensor-parallel rendezvous: {e}") from e

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - leaving a broken group is best effort
                log.debug("destroying the process group failed", exc_info=True)


def leave_process(code: int) -> NoReturn:
    """End a rank's process with `code` once its group is closed: flush what it wrote, then skip the
    interpreter's finalisation. There, objects that own gloo's and the store's native threads are torn
    down in no fixed order, and a thread still joinable is std::terminate ("terminate called without
    an active exception": twice in fresh clones, each time a test rank exiting after its last step;
    pytorch/pytorch#179291 describes the race). Nothing is left to finalise: the group is closed."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing more can be said through it
            pass
    os._exit(code)


def make_store(spec: GroupSpec) -> Any:
    """The rendezvous store: rank 0 listens at the leader address and nowhere else (port 0: a free
    one, which the store reports as `.port`), the others connect to it, within startup_s.

    torch's TCPStore binds every interface by itself, so rank 0 binds the socket here, on the
    leader host only, and hands the store its descriptor."""
    timeout = timedelta(seconds=spec.startup_s)
    if spec.rank != 0:
        return dist.TCPStore(spec.leader_host, spec.leader_port, spec.size, is_master=False, timeout=timeout,
                             wait_for_workers=False)
    listener = bound_listener(spec.leader_host, spec.leader_port)
    try:
        return dist.TCPStore(spec.leader_host, listener.getsockname()[1], spec.size, is_master=True,
                             timeout=timeout, wait_for_workers=False, master_listen_fd=listener.fileno())
    finally:
        listener.detach()  # the store owns the descriptor now


def bound_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host`'s address only (an IPv4 or IPv6 literal, or a name)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock
