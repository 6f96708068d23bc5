"""DNS discovery: the prefill workers behind a headless Service's name (each ready pod an address),
and the decode workers given by URL. For a decode pod's sidecar behind a gateway (`--prefill-dns`):
it needs no access to the Kubernetes API (worker pods have no token), and a prefill endpoint the
picker names is used only when the name resolves to it, so a forged header cannot make the sidecar
send the service's internal secret anywhere else.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

from tandem.router.discovery.static import static_targets
from tandem.router.workers import Target

log = logging.getLogger("tandem.router.discovery")


def _url(address: str, port: int) -> str:
    return f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"


class DnsDiscovery:
    """Resolve `host` every `interval_s`; `on_change(targets)` when the addresses change."""

    def __init__(self, host: str, port: int, decode: list[str], interval_s: float = 2.0,
                 on_change: Callable[[list[Target]], None] = lambda t: None) -> None:
        self.host, self.port, self.decode, self.interval_s = host, port, decode, interval_s
        self.on_change = on_change
        self._task: asyncio.Task | None = None
        self._last: list[str] | None = None

    async def resolve(self) -> list[str]:
        """The prefill workers' URLs the name resolves to now (sorted; [] when it does not resolve)."""
        try:
            found = await asyncio.get_running_loop().getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        except OSError as e:
            log.warning("resolving %s: %s", self.host, e)
            return []
        return sorted({_url(info[4][0], self.port) for info in found})

    async def _refresh(self) -> None:
        urls = await self.resolve()
        if urls != self._last:
            self._last = urls
            self.on_change(static_targets(urls, self.decode))

    async def _run(self) -> None:
        while True:
            await self._refresh()
            await asyncio.sleep(self.interval_s)

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.on_change(static_targets([], self.decode))  # the decode workers at once
        self._task = (loop or asyncio.get_running_loop()).create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None


def parse_host(value: str, default_port: int) -> tuple[str, int]:
    """`HOST[:PORT]` -> (host, port)."""
    host, sep, port = value.rpartition(":")
    if sep and port.isdigit() and host and not host.endswith(":"):
        return host.strip("[]"), int(port)
    return value, default_port
