"""Rank 0's side of a tensor-parallel worker: it hosts the rendezvous, starts the other ranks of its
node as processes (`tandem worker --tensor-parallel N --rank K --leader-address ...`), decides what
every rank must agree on (agreement.py), builds the one Engine of the group (whose runner sends each
step to every rank: executor.py), and then gathers the ranks' endpoints for the group's KV
transport (group_transport.py).

A rank it started that exits while the group starts ends this process too (exit 1): the group can
never form, and waiting for it would only hold the start-up budget. Once serving, a rank that dies
fails the group through the step's collectives (executor.py), which fails /health.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from tandem.contracts.parallelism import ParallelismError
from tandem.worker.engine.parallel.node_ranks import start_node_ranks
from tandem.worker.engine.parallel.placement import Placement
from tandem.worker.engine.parallel.sharding import config_problem

log = logging.getLogger("tandem.worker.engine.parallel")

_WATCH_S = 0.5


class RankZero:
    def __init__(self, cfg: Any, engine_id: str, leader_url: str):
        self.cfg = cfg
        self.leader_url = leader_url  # rank 0's HTTP API: the ranks ask it about leases
        self.placement: Placement = cfg.placement
        self.engine_id = engine_id
        self.group: Any = None
        self.engine: Any = None
        self.children: list[Any] = []
        self._store: Any = None
        self._spec: Any = None
        self._starting = True
        self._device: Any = None

    def start(self) -> None:
        """On the main thread (a child dies with the thread that started it): the rendezvous store,
        then the node's other ranks."""
        from tandem.worker.engine.parallel.follower import rank_device
        from tandem.worker.engine.parallel.group import GroupSpec, make_store

        p = self.placement
        config_json = Path(self.cfg.model).expanduser() / "config.json"
        if config_json.is_file():  # a hub id is checked when the ranks read their slices
            problem = config_problem(json.loads(config_json.read_text()), p.size)
            if problem is not None:
                raise ParallelismError(f"{self.cfg.model}: {problem}")
        spec = GroupSpec(p.size, p.rank, p.leader_host, p.leader_port, timeout_s=self.cfg.tp_timeout_s,
                         secret=self.cfg.internal_secret)
        self._store = make_store(spec)
        self._spec = dataclasses.replace(spec, leader_port=self._store.port)
        self._device = rank_device(self.cfg.device, 0)
        self.children = start_node_ranks(self.cfg, f"{p.leader_host}:{self._spec.leader_port}", self._device)
        log.info("tensor parallelism %d: rank 0 at %s:%d, started ranks %s", p.size, p.leader_host,
                 self._spec.leader_port, list(p.started_ranks) or "none (other nodes start theirs)")
        threading.Thread(target=self._watch, name="tandem-tp-watch", daemon=True).start()

    def _watch(self) -> None:
        """While the group starts, a started rank that exits ends this process."""
        stop = threading.Event()
        while self._starting and not stop.wait(_WATCH_S):
            for c in self.children:
                if c.returncode is not None and self._starting:
                    log.error("rank process %s exited with %s while the group started: giving up", c.name,
                              c.returncode)
                    os._exit(1)

    def load_engine(self, cfg: Any, on_step: Any) -> Any:
        """Join the group, publish the agreement and build the group's engine (blocking: run it on a
        thread; the runtime's load_engine). The other ranks load and compile alongside."""
        from tandem.worker.engine.engine import Engine
        from tandem.worker.engine.loader import load_model
        from tandem.worker.engine.parallel.agreement import Agreement
        from tandem.worker.engine.parallel.group import ParallelGroup
        from tandem.worker.engine.pool_sizing import size_pool

        self.group = ParallelGroup.join(self._spec, self._device, self._store)
        ecfg = dataclasses.replace(cfg.engine_config(), device=str(self._device))
        lm = load_model(ecfg.model, dtype=ecfg.dtype, device=ecfg.device, max_model_len=ecfg.max_model_len,
                        trust_remote_code=ecfg.trust_remote_code, backend=ecfg.model_backend,
                        tensor_parallel=self.group.size, group=self.group)
        layout, context = size_pool(ecfg, lm)  # as the engine will: the group's blocks, from rank 0's memory
        ecfg.num_blocks = layout.num_blocks
        kv = cfg.kv_transfer_config("")
        self.group.publish("agreement", Agreement(
            engine=dataclasses.asdict(ecfg), engine_id=self.engine_id, leader_url=self.leader_url,
            max_context=context, role=cfg.role.value, kv_backend=cfg.kv_backend.value,
            kv={"timeout_s": kv.timeout_s, "lease_s": kv.lease_s, "extra": kv.extra, "serve": kv.serve}))
        self.engine = Engine(ecfg, loaded=lm, lease_s=cfg.kv_lease_s, on_step=on_step)
        return self.engine

    def wait_for_ranks(self) -> list[Any]:
        """Every other rank's endpoint (a KVRank), once it serves; start-up is then over."""
        from tandem.contracts.kv_source import KVRank

        endpoints = self.group.gather_published("endpoint", KVRank, ranks=range(1, self.placement.size))
        self.engine.runner.ranks = tuple(endpoints)
        self.group.serving()
        self._starting = False
        return endpoints

    async def serving(self, transport: Any) -> Any:
        """Once every rank serves: the group's KV transport around rank 0's (None: no transport)."""
        import asyncio

        ranks = await asyncio.to_thread(self.wait_for_ranks)
        if transport is None:
            return None
        from tandem.worker.engine.parallel.group_transport import GroupTransport

        return GroupTransport(transport, ranks)

    def close(self) -> None:
        """Stop the group: the ranks leave when told (or die with this process), then are reaped."""
        self._starting = False
        if self.engine is not None:
            self.engine.runner.close()  # executor.LeaderRunner
        for c in self.children:
            c.stop(grace_s=10.0)
        if self.group is not None:
            self.group.close()

