"""Child processes that are started, watched and stopped for sure: `tandem up` runs its router and
workers with this, and so do the tests and benchmarks that need real processes.

Each child gets its own process group (a stop reaches whatever it started), dies with its parent
(PR_SET_PDEATHSIG, so nothing is orphaned), may be pinned to one CPU, and writes its output to a
log file or to ours. Readiness is an HTTP path answering 200.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

PR_SET_PDEATHSIG = 1


# Ports handed out by free_port in this process: never twice, so servers started together differ.
_HANDED_OUT: set[int] = set()
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _below_ephemeral() -> tuple[int, int] | None:
    """Ports below the OS's ephemeral range (where it picks for bind(0) and connect()), or None."""
    try:
        low = int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return (max(1024, low - 12_000), low) if low - 1024 >= 2_000 else None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now, for a server to bind a moment later. Chosen below the
    OS's ephemeral range: a port the OS picked (bind to 0) could be given to another process's own
    socket before the server binds it (vLLM's ZMQ sockets took one: "Address already in use")."""
    span = _below_ephemeral()
    for _ in range(200 if span else 0):
        port = random.randrange(*span)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _child_setup(cpu: int | None) -> None:
    """Runs in the child before exec: die with the parent, and optionally pin to one core."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


class ManagedProcess:
    """One child process whose HTTP server (if any) answers at `url`."""

    ready_path = "/ready"  # answers 200 once the child can serve

    def waiting_for(self) -> str:
        """What the child is doing while it is not ready yet, said to the user ('' when nothing to say)."""
        return ""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None, url: str = "",
                 cpu: int | None = None, log_path: Path | None = None, capture: bool = True,
                 role: str = ""):
        self.name, self.argv, self.url, self.cpu, self.role = name, argv, url, cpu, role
        self.env = dict(os.environ if env is None else env)
        self.capture = capture  # False: the child writes to our stdout/stderr
        if capture and log_path is None:
            log_path = Path(tempfile.mkstemp(prefix=f"tandem-{name}-", suffix=".log")[1])
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self._own_group = False  # started by start(): the child leads its own process group
        self.ready_after: float | None = None  # seconds from start to ready, once seen

    def start(self) -> ManagedProcess:
        cpu = self.cpu
        self._own_group = True
        if self.capture:
            assert self.log_path is not None
            with open(self.log_path, "ab") as out:
                self.proc = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                             start_new_session=True, preexec_fn=lambda: _child_setup(cpu))
        else:
            self.proc = subprocess.Popen(self.argv, env=self.env, start_new_session=True,
                                         preexec_fn=lambda: _child_setup(cpu))
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} was never started"
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    # --- HTTP ---------------------------------------------------------------------------------

    def status(self, path: str, timeout_s: float = 5.0) -> int:
        """The HTTP status of GET url+path; 0 when nothing answers."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout_s) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except (OSError, ValueError):
            return 0

    def get_json(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return json.load(r)

    def get_text(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return r.read().decode()

    def metric(self, series: str) -> float:
        """The value of one series in /metrics, e.g. 'tandem_router_aborts_total' (0 when absent)."""
        for line in self.get_text("/metrics").splitlines():
            if line.startswith(series + " ") or line == series:
                return float(line.split()[-1])
        return 0.0

    def wait_ready(self, path: str = "/ready", timeout_s: float = 180.0) -> None:
        """Until `path` answers 200; a child that exits, or is not ready in time (then killed), raises
        with the end of its log."""
        assert self.proc is not None, f"{self.name} was never started"
        t0 = time.monotonic()
        while self.status(path, timeout_s=1.0) != 200:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            if time.monotonic() - t0 > timeout_s:
                self.kill()
                raise RuntimeError(f"{self.name} not ready in {timeout_s} s:\n{self.log()[-4000:]}")
            time.sleep(0.2)
        self.ready_after = time.monotonic() - t0

    # --- signals ------------------------------------------------------------------------------

    def signal(self, sig: int) -> None:
        """Signal the child itself (not its group): what a crash or a kubelet's SIGTERM looks like."""
        if self.alive():
            self.proc.send_signal(sig)

    def terminate(self) -> None:
        self.signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the child's whole group (or the child, if it has none of its own) and reap it."""
        if self.proc is None:
            return
        try:
            if self._own_group:
                os.killpg(self.proc.pid, signal.SIGKILL)
            else:
                self.proc.kill()
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def stop(self, grace_s: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL the whole group if it has not exited within grace_s."""
        if self.proc is None:
            return None
        self.terminate()
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        self.kill()  # also anything the child started and left behind
        return self.proc.returncode


class Supervisor:
    """Children started together and stopped together, whatever happens."""

    def __init__(self, children: Iterable[ManagedProcess] = ()) -> None:
        self.children: list[ManagedProcess] = list(children)

    def add(self, child: ManagedProcess) -> ManagedProcess:
        self.children.append(child)
        return child

    def start(self, child: ManagedProcess) -> ManagedProcess:
        if child not in self.children:
            self.children.append(child)
        return child.start()

    def dead(self) -> list[ManagedProcess]:
        return [c for c in self.children if c.proc is not None and c.proc.poll() is not None]

    def wait_ready(self, children: Iterable[ManagedProcess], path: str = "/ready",
                   timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        for c in children:
            c.wait_ready(path, max(0.0, deadline - time.monotonic()))

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every live child (the last started first), wait up to grace_s in all, then
        SIGKILL each group."""
        live = [c for c in self.children if c.alive()]
        for c in reversed(live):
            c.terminate()
        deadline = time.monotonic() + grace_s
        for c in live:
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for c in self.children:
            c.kill()
