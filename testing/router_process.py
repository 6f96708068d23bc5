"""One `tandem router` as a real process on a loopback port, over workers given by URL: started,
waited for (/health), killed for sure. For the router's tests of signals, overload and slow clients."""

from __future__ import annotations

import sys

from tandem.worker.local.processes import ManagedProcess, free_port


class RouterProcess(ManagedProcess):
    """`tandem router --host 127.0.0.1 --port P ARGS`; `start()` returns once it answers /health."""

    def __init__(self, *args: str, port: int | None = None, env: dict[str, str] | None = None):
        self.port = port or free_port()
        argv = [sys.executable, "-m", "tandem.cli.main", "router", "--host", "127.0.0.1",
                "--port", str(self.port), *args]
        super().__init__("router", argv, env=env, url=f"http://127.0.0.1:{self.port}", role="router")

    def start(self, ready_path: str = "/ready", timeout_s: float = 60.0) -> RouterProcess:
        super().start()
        self.wait_ready(ready_path, timeout_s)
        return self
