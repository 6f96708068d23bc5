"""A follower rank (K > 0) of a tensor-parallel worker: `tandem worker --tensor-parallel N --rank K`.

It joins the group at the leader's address, reads the agreement rank 0 published (agreement.py),
loads its slices of the weights, allocates its pool (its KV heads, the group's block count),
compiles the decode step in step with the others, starts its rank server (rank_server.py: its KV
transport and a small HTTP API), tells rank 0 where that is, and then runs every step rank 0 sends
(executor.follow) until rank 0 stops the group, also after a SIGTERM (rank 0 drains first, and
its migrating streams still need this rank's heads). A group that fails (rank 0 or another rank
gone or silent past --tp-timeout-s) ends this process with exit code 1.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Any

from tandem.worker.engine.heap import freeze_startup_heap

log = logging.getLogger("tandem.worker.engine.parallel")


def rank_device(device: str, local_index: int) -> Any:
    """This rank's device: cpu, or one GPU per rank of the node (auto picks cuda:local_index)."""
    import torch

    if device in ("auto", "cuda") and torch.cuda.is_available():
        return torch.device("cuda", local_index)
    if device == "auto":
        return torch.device("cpu")
    return torch.device(device)


def read_agreement(group: Any) -> Any:
    """What rank 0 published (it does before building its own engine)."""
    from tandem.worker.engine.parallel.agreement import Agreement

    return group.gather_published("agreement", Agreement, ranks=range(1))[0]


def load_rank(agreement: Any, group: Any) -> Any:
    """This rank's forward pass over its share and its pool, compiled in step with the other ranks."""
    import torch
    from tandem.worker.engine.loader import load_model
    from tandem.worker.engine.model_runner import rank_runner
    from tandem.worker.engine.pool_sizing import kv_layout_for

    cfg = agreement.engine_config()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    lm = load_model(cfg.model, dtype=cfg.dtype, device=str(group.device), max_model_len=cfg.max_model_len,
                    trust_remote_code=cfg.trust_remote_code, backend=cfg.model_backend,
                    tensor_parallel=group.size, group=group)
    layout = kv_layout_for(lm.config, cfg.num_blocks, cfg.block_size, lm.dtype, group)
    pool = torch.zeros(layout.shape, dtype=lm.dtype, device=group.device)
    runner, why = rank_runner(lm, pool, layout, cfg.compile, agreement.max_context)  # hf/tensor_parallel.py
    log.info("rank %d ready: %d KV heads of %d in %d blocks, %s", group.rank, layout.local_kv_heads,
             layout.num_kv_heads, layout.num_blocks, why)
    return runner


def run_follower(cfg: Any) -> int:
    """The follower's whole life; its exit code."""
    import torch
    from tandem.worker.engine.errors import ModelLoadError
    from tandem.worker.engine.parallel.executor import follow
    from tandem.worker.engine.parallel.group import GroupFailed, GroupSpec, ParallelGroup
    from tandem.worker.engine.parallel.node_ranks import start_node_ranks
    from tandem.worker.engine.parallel.rank_server import RankServer

    p = cfg.placement
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    # SIGTERM (a group's pods deleted together) waits for rank 0, which drains first: its migrating
    # streams need this rank's KV heads. Rank 0 stops the group, or its loss ends this rank.
    signal.signal(signal.SIGTERM, lambda *_: log.info("rank %d: SIGTERM, leaving when rank 0 stops the group",
                                                      p.rank))
    spec = GroupSpec(p.size, p.rank, p.leader_host, p.leader_port, timeout_s=cfg.tp_timeout_s,
                     secret=cfg.internal_secret)
    device = rank_device(cfg.device, p.rank % p.local_ranks)
    server = None
    group = None
    children = start_node_ranks(cfg, f"{p.leader_host}:{p.leader_port}", device)  # the node's other ranks
    try:
        t0 = time.monotonic()
        group = ParallelGroup.join(spec, device)
        agreement = read_agreement(group)
        runner = load_rank(agreement, group)
        server = RankServer(cfg, agreement, runner.pool, runner.layout)
        group.publish("endpoint", server.start())
        group.serving()
        server.serving = True
        freeze_startup_heap()
        log.info("rank %d serving %.1fs after start", p.rank, time.monotonic() - t0)
        follow(group, runner)
        return 0
    except GroupFailed as e:
        log.error("rank %d leaves: %s", p.rank, e)
        return 1
    except (ModelLoadError, ValueError, RuntimeError, OSError) as e:
        log.exception("rank %d failed to start: %s", p.rank, e)
        return 1
    finally:
        if server is not None:
            server.stop()
        if group is not None:
            group.close()
        for c in children:  # they leave with the group; reap them
            c.stop(grace_s=10.0)
