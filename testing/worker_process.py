"""One `tandem worker` as a real process on a loopback port: started, waited for, killed for sure.

For end-to-end tests that must kill or restart a worker (the KV handoff's failure tests).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tandem.contracts.internal_auth import SECRET_ENV
from tandem.worker.local.processes import ManagedProcess, free_port


class WorkerProcess(ManagedProcess):
    """`tandem worker --role ROLE` with the given flags; `start()` returns once /ready is 200."""

    def __init__(self, model: Path, role: str, *args: str, port: int | None = None,
                 env: dict[str, str] | None = None, secret: str | None = None):
        """`secret`: the service's internal secret, passed as a worker gets it (the environment)."""
        self.port = port or free_port()
        argv = [sys.executable, "-m", "tandem.cli.main", "worker", "--role", role,
                "--model", str(model), "--host", "127.0.0.1", "--port", str(self.port),
                "--threads", "1", *([] if "--kv-port" in args else ["--kv-port", "0"]), *args]
        base = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
        super().__init__(f"{role} worker", argv, base | {
            "UCX_TLS": "tcp", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"} | (env or {})
            | ({SECRET_ENV: secret} if secret else {}),
            url=f"http://127.0.0.1:{self.port}", role=role)

    def start(self, ready_timeout_s: float = 180.0) -> WorkerProcess:
        super().start()
        self.wait_ready("/ready", ready_timeout_s)
        return self
