"""The other ranks of this node, started as processes by the node's first rank (rank 0 alone on a
node; in a group spanning nodes, every pod's process): `tandem worker --tensor-parallel N --rank K
--local-ranks 1 --leader-address HOST:PORT`, on a free port each, one GPU each (cuda:<local index>).
Started from the main thread: a child dies with the thread that started it (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import sys
from typing import Any


def follower_argv(cfg: Any, rank: int, leader: str, device: str) -> list[str]:
    """The command line of a rank this process starts: its place in the group and its own network
    and logging; everything else it takes from rank 0's agreement."""
    argv = [sys.executable, "-m", "tandem.cli.main", "worker", "--model", cfg.model, "--role", cfg.role.value,
            "--tensor-parallel", str(cfg.tensor_parallel), "--rank", str(rank), "--local-ranks", "1",
            "--leader-address", leader, "--host", cfg.host, "--port", "0", "--kv-port", "0", "--device", device,
            "--kv-backend", cfg.kv_backend.value, "--tp-timeout-s", str(cfg.tp_timeout_s),
            "--log-format", cfg.log_format, "--log-level", cfg.log_level]
    if not cfg.migrate_on_drain and cfg.kv_backend.value != "none":
        argv.append("--no-migrate-on-drain")
    if cfg.threads:
        argv += ["--threads", str(cfg.threads)]
    if cfg.internal_secret_file:
        argv += ["--internal-secret-file", cfg.internal_secret_file]
    return argv


def start_node_ranks(cfg: Any, leader: str, device: Any) -> list[Any]:
    """Start this node's other ranks (placement.started_ranks); `device` is this process's."""
    from tandem.worker.local.processes import ManagedProcess

    children = []
    for i, rank in enumerate(cfg.placement.started_ranks, start=1):
        child_device = f"cuda:{device.index + i if device.index is not None else i}" if device.type == "cuda" \
            else str(device)
        argv = follower_argv(cfg, rank, leader, child_device)
        children.append(ManagedProcess(f"rank-{rank}", argv, capture=False).start())
    return children
