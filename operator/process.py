"""The operator process: its endpoints, leader election when asked, then kopf.

    endpoints (liveness, /metrics)     from start to exit, standby or leader
    --leader-election                  wait as a standby until this replica holds the Lease
    kopf                               only while leading; the Lease is renewed meanwhile
    on SIGTERM                         kopf stops, the Lease is released, the process exits 0
    on a lost Lease                    exit 1 at once: nothing more is written (the kubelet restarts it)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from typing import Any

from tandem.operator import endpoints
from tandem.operator.election import ElectionConfig
from tandem.operator.leader import LeaderElector, LeadershipLost
from tandem.operator.metrics import METRICS

log = logging.getLogger(__name__)


def _api_client() -> Any:
    from kubernetes import client
    from kubernetes import config as kube_config

    try:
        kube_config.load_incluster_config()
    except kube_config.ConfigException:
        kube_config.load_kube_config()
    return client.ApiClient()


async def _stand_by(elector: LeaderElector) -> bool:
    """Waits for the Lease; False when SIGTERM or SIGINT came first."""
    loop = asyncio.get_running_loop()
    waiting = asyncio.create_task(elector.acquire())
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, waiting.cancel)
    try:
        await waiting
        return True
    except asyncio.CancelledError:
        log.info("leader election: stopped while standing by")
        return False
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def _exit_on_loss(task: asyncio.Task) -> None:
    """A leader that lost the Lease must stop writing at once: before the other replica may start."""
    if task.cancelled():
        return
    error = task.exception()
    log.critical("leader election: %s; exiting", error if isinstance(error, LeadershipLost) else repr(error))
    logging.shutdown()
    os._exit(1)


async def serve(liveness: str | None, election: ElectionConfig | None, kopf_kwargs: dict[str, Any]) -> int:
    """Runs until kopf stops (0) or the process was stopped while standing by (0)."""
    import kopf

    runner = await endpoints.serve(liveness) if liveness else None
    elector = keeper = None
    try:
        if election is not None:
            METRICS.leader.set(0)
            elector = LeaderElector(_api_client(), election)
            if not await _stand_by(elector):
                return 0
            keeper = asyncio.create_task(elector.keep())
            keeper.add_done_callback(_exit_on_loss)
        METRICS.leader.set(1)
        await kopf.operator(standalone=True, **kopf_kwargs)
    finally:
        if keeper is not None:
            keeper.remove_done_callback(_exit_on_loss)
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
        METRICS.leader.set(0)
        if elector is not None:
            await elector.release()
        if runner is not None:
            await runner.cleanup()
    return 0
