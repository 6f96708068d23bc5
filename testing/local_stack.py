"""`tandem up` as a fixture: start a local stack on free ports, wait for it, stop it for sure.

Used by the router's end-to-end tests and the benchmarks. The stack's processes (router and
workers) are listed in the state file `tandem up` writes once everything is ready.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.contracts.internal_auth import SECRET_ENV, auth_headers
from tandem.worker.local.processes import ManagedProcess, free_port


@dataclass
class LocalStack:
    """One `tandem up` process and what it started."""

    model: Path
    mode: str = "disaggregated"
    args: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    startup_timeout_s: float = 240.0
    proc: subprocess.Popen | None = None
    processes: list[dict[str, Any]] = field(default_factory=list)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="tandem-up-")))
    # handed to `tandem up` (which gives it to every child), so tests can call the workers too
    secret: str = field(default_factory=lambda: secrets.token_urlsafe(32))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "up.log"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self) -> LocalStack:
        state = self.workdir / "state.json"
        argv = [
            sys.executable, "-m", "tandem.cli.main", "up", "--model", str(self.model),
            "--mode", self.mode, "--port", str(self.port), "--state-file", str(state), *self.args,
        ]
        self.up = ManagedProcess("tandem-up", argv, os.environ | {"PYTHONUNBUFFERED": "1", SECRET_ENV: self.secret},
                                 log_path=self.log_path).start()
        self.proc = self.up.proc
        deadline = time.monotonic() + self.startup_timeout_s
        while not state.exists():  # `tandem up` writes it atomically once everything is ready
            if self.proc.poll() is not None:
                raise RuntimeError(f"tandem up exited with {self.proc.returncode}:\n{self.log()[-5000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"tandem up not ready after {self.startup_timeout_s}s:\n{self.log()[-5000:]}")
            time.sleep(0.25)
        self.processes = json.loads(state.read_text())
        return self

    def info(self, worker_url: str, timeout_s: float = 5.0) -> dict[str, Any]:
        """A worker's /internal/info, proving membership with the stack's internal secret."""
        req = urllib.request.Request(worker_url + "/internal/info", headers=auth_headers(self.secret))
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.load(r)

    def workers(self, role: str | None = None) -> list[dict[str, Any]]:
        return [p for p in self.processes if p["role"] != "router" and role in (None, p["role"])]

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        pid = next(p["pid"] for p in self.processes if p["name"] == name)
        os.kill(pid, sig)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM `tandem up` (it stops its children), then make sure nothing is left."""
        if self.proc is None:
            return None
        self.up.stop(timeout_s)
        for p in self.processes:  # belt and braces: no orphan survives a broken stop
            try:
                os.killpg(p["pid"], signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        return self.proc.returncode

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
