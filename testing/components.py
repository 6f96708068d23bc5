"""The control plane's processes: each started in its own process group with its log in the work
dir, checked for an early exit while the cluster waits on it, and stopped for sure."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path


class ClusterError(RuntimeError):
    """The control plane could not be found, started or reached; the message says what to do."""


@dataclass
class Component:
    name: str
    argv: list[str]
    popen: subprocess.Popen[bytes] | None = None
    pid: int = 0
    log: Path = field(default_factory=Path)


class Components:
    """The processes one cluster started, in start order."""

    def __init__(self, work_dir: Path) -> None:
        self.work_dir = work_dir
        self.procs: list[Component] = []

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        log = self.work_dir / "logs" / f"{name}.log"
        with log.open("ab") as out:
            popen = subprocess.Popen(
                argv,
                env=None if env is None else os.environ | env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: stop() kills it whole
                cwd=self.work_dir,
            )
        self.procs.append(Component(name, argv, popen, popen.pid, log))

    def check_alive(self) -> bool:
        """True, or ClusterError naming the one that exited (waiting longer cannot help then)."""
        for proc in self.procs:
            if proc.popen is not None and proc.popen.poll() is not None:
                raise ClusterError(f"{proc.name} exited with code {proc.popen.returncode}")
        return True

    def stop(self) -> None:
        """Every process group: SIGTERM, then SIGKILL after a short grace."""
        for proc in reversed(self.procs):
            signal_group(proc.pid, signal.SIGTERM)
        # Short grace: the store is thrown away, so a clean shutdown buys nothing.
        deadline = time.monotonic() + 3
        for proc in reversed(self.procs):
            if proc.popen is not None:
                try:
                    proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            signal_group(proc.pid, signal.SIGKILL)
            if proc.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.popen.wait(timeout=5)
        self.procs.clear()

    def write_pids(self, path: Path) -> Path:
        """Records the pids so `down` can stop a cluster another process left running."""
        path.write_text(
            json.dumps([{"name": p.name, "pid": p.pid, "exe": p.argv[0]} for p in self.procs])
        )
        return path

    def log_tails(self, lines: int = 15) -> str:
        out = []
        for proc in self.procs:
            try:
                text = proc.log.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            out.append(f"--- {proc.name} ({proc.log}) ---\n" + "\n".join(text))
        return "\n".join(out)


def signal_group(pid: int, sig: signal.Signals) -> None:
    if pid <= 0:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
