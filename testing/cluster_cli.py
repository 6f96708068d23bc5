"""`make cluster`: a test control plane left running in a state dir, and stopped again.

    python -m tandem.testing.cluster up     # writes .cluster/kubeconfig, leaves it running
    python -m tandem.testing.cluster down   # stops it and removes .cluster/
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tandem.testing.cluster import Cluster
from tandem.testing.components import ClusterError, signal_group
from tandem.testing.kube_nodes import POOL_LABEL


def _pid_runs(pid: int, exe: str) -> bool:
    """True when pid is alive and still runs exe (not a recycled pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return bool(cmdline) and cmdline[0].decode(errors="replace") == exe


def cluster_up(state_dir: Path) -> Cluster:
    """Starts a detached cluster in state_dir (kubeconfig, logs, pids.json) and returns it."""
    pids = state_dir / "pids.json"
    if pids.exists() and any(_pid_runs(p["pid"], p["exe"]) for p in json.loads(pids.read_text())):
        raise ClusterError(
            f"a cluster is already running from {state_dir}; stop it with `make cluster-down`"
        )
    shutil.rmtree(state_dir, ignore_errors=True)
    state_dir.mkdir(parents=True)
    cluster = Cluster(work_dir=state_dir).start()
    cluster.write_pids()
    return cluster


def cluster_down(state_dir: Path) -> int:
    """Stops the components recorded in state_dir/pids.json and removes state_dir."""
    pids = state_dir / "pids.json"
    stopped = 0
    if pids.exists():
        procs = [p for p in json.loads(pids.read_text()) if _pid_runs(p["pid"], p["exe"])]
        for p in reversed(procs):
            signal_group(p["pid"], signal.SIGTERM)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and any(_pid_runs(p["pid"], p["exe"]) for p in procs):
            time.sleep(0.1)
        for p in procs:
            if _pid_runs(p["pid"], p["exe"]):
                signal_group(p["pid"], signal.SIGKILL)
        stopped = len(procs)
    shutil.rmtree(state_dir, ignore_errors=True)
    return stopped


def main(argv: Sequence[str] | None = None) -> int:
    """`up` leaves a cluster running with .cluster/kubeconfig; `down` stops it."""
    parser = argparse.ArgumentParser(
        prog="python -m tandem.testing.cluster",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path.cwd() / ".cluster",
        help="state dir: kubeconfig, logs, pids.json (default: ./.cluster)",
    )
    args = parser.parse_args(argv)
    state_dir = args.dir.resolve()
    try:
        if args.action == "up":
            cluster = cluster_up(state_dir)
            print(f"cluster up in {cluster.startup_seconds:.1f}s: {cluster.server}")
            print(f"  kubectl --kubeconfig {cluster.kubeconfig} get nodes -L {POOL_LABEL}")
            print(f"  binaries: {cluster.bin_dir}; logs: {state_dir / 'logs'}")
            print("  stop it with: make cluster-down")
        else:
            stopped = cluster_down(state_dir)
            print(f"cluster down ({stopped} processes stopped)")
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
