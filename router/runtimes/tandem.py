"""The `tandem` runtime: Tandem's own workers, reached over the internal protocol
(tandem.contracts.protocol) by `HttpWorkerClient`."""

from __future__ import annotations

import aiohttp
from tandem.router.config import RouterConfig
from tandem.router.worker_client import HttpWorkerClient, Timeouts


def create_client(session: aiohttp.ClientSession, config: RouterConfig) -> HttpWorkerClient:
    """The client with the configured timeouts and the service's internal secret."""
    timeouts = Timeouts(connect_s=config.connect_timeout_s, prefill_s=config.prefill_timeout_s,
                        chunk_s=config.chunk_timeout_s)
    return HttpWorkerClient(session, timeouts, secret=config.internal_secret)
