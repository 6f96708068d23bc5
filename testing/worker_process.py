"""One `tandem worker` as a real process on a loopback port: started, waited for, killed for sure.

For end-to-end tests that must kill or restart a worker (the KV handoff's failure tests).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ChildProcess:
    """A child process whose HTTP server answers at `url`, its output in a log file; stopped for sure.

    The one place the test helpers start, poll, signal and stop processes (WorkerProcess here,
    the pod stand-ins of tandem.testing.pod_workers, the KV peers of tandem.testing.kv_peer).
    """

    def __init__(self, name: str, argv: list[str], env: dict[str, str], url: str = ""):
        self.name, self.argv, self.env, self.url = name, argv, env, url
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(tempfile.mkstemp(prefix=f"tandem-{name}-", suffix=".log")[1])

    def launch(self) -> None:
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, path: str = "/ready", timeout_s: float = 180.0) -> None:
        """Until `path` answers 200; a process that exits or times out (then killed) raises with its log."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while self.status(path) != 200:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{self.name} not ready in {timeout_s} s:\n{self.log()[-4000:]}")
            time.sleep(0.2)

    def status(self, path: str) -> int:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return 0

    def get_json(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return json.load(r)

    def get_text(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return r.read().decode()

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited within timeout_s."""
        self.terminate()
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()


class WorkerProcess(ChildProcess):
    """`tandem worker --role ROLE` with the given flags; `start()` returns once /ready is 200."""

    def __init__(self, model: Path, role: str, *args: str, port: int | None = None,
                 env: dict[str, str] | None = None):
        self.port = port or free_port()
        argv = [sys.executable, "-m", "tandem.cli.main", "worker", "--role", role,
                "--model", str(model), "--host", "127.0.0.1", "--port", str(self.port),
                "--threads", "1", *args]
        super().__init__(f"{role} worker", argv, os.environ | {
            "UCX_TLS": "tcp", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"} | (env or {}),
            url=f"http://127.0.0.1:{self.port}")

    def start(self, ready_timeout_s: float = 180.0) -> WorkerProcess:
        self.launch()
        self.wait_ready("/ready", ready_timeout_s)
        return self
