"""Result files: bench/results/<scenario>/<run-id>.json, each a scenario's result with what made it.

The envelope (scenario, run id, command, commit, host, wall time) is the same for every scenario,
so any result can be traced to the code and the machine that produced it.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parents[1]
ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
ENVELOPE_KEYS = ("scenario", "run_id", "command", "commit", "host", "wall_s", "result")


def new_run_id() -> str:
    """The UTC time now, as run ids and file names are written: 20261201-090754."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime())


def json_safe(x: Any) -> Any:
    """NaN and infinities become null, so the file is strict JSON; tuples become lists."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [json_safe(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    return x


def host_info() -> dict[str, Any]:
    """The machine a figure was measured on, and how busy it was when asked."""
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "loadavg": list(os.getloadavg())}


RUN_KEYS = ("results_dir", "out_dir", "no_save", "run_id", "scenario", "load")  # set by the CLI, not options


def scenario_settings(args: Any) -> dict[str, Any]:
    """A scenario's options as given (an argparse Namespace), without what the CLI adds to it."""
    return {k: v for k, v in vars(args).items() if k not in RUN_KEYS}


def git_commit() -> str | None:
    """The checkout's commit (with '+dirty' when it has uncommitted changes); None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def envelope(scenario: str, run_id: str, result: dict[str, Any], argv: list[str], wall_s: float,
             load: dict[str, Any] | None = None) -> dict[str, Any]:
    """The result with what made it; `load` is the load average sampled through the run
    (bench/lib/load_sampler.py), kept in host as loadavg_during."""
    host = host_info() | ({"loadavg_during": load} if load is not None else {})
    return {"scenario": scenario, "run_id": run_id, "command": " ".join(["python -m bench", scenario, *argv]),
            "commit": git_commit(), "host": host, "wall_s": round(wall_s, 1), "result": json_safe(result)}


def save_result(results_dir: Path, scenario: str, run_id: str, result: dict[str, Any], argv: list[str],
                wall_s: float, load: dict[str, Any] | None = None) -> Path:
    path = Path(results_dir) / scenario / f"{run_id}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(envelope(scenario, run_id, result, argv, wall_s, load), indent=1) + "\n")
    return path


def result_files(scenario: str, results_dir: Path = RESULTS_DIR) -> list[Path]:
    """A scenario's result files, oldest first (run ids sort by time)."""
    return sorted((Path(results_dir) / scenario).glob("*.json"))


def latest_result(scenario: str, results_dir: Path = RESULTS_DIR) -> dict[str, Any] | None:
    """The newest result of a scenario (its envelope), or None when it never ran."""
    files = result_files(scenario, results_dir)
    return json.loads(files[-1].read_text()) if files else None


def read_result(scenario: str, run_id: str | None = None, results_dir: Path = RESULTS_DIR) -> dict[str, Any] | None:
    """One run's result of a scenario (its envelope); without a run id, the newest (latest_result)."""
    if run_id is None:
        return latest_result(scenario, results_dir)
    return json.loads((Path(results_dir) / scenario / f"{run_id}.json").read_text())
