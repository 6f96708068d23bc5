"""Where a worker's time went, from py-spy raw profiles: samples per thread, and the engine thread's
samples by what it was doing.

    python -m bench profile_summary bench/out/<scenario>/<run-id>/profiles/*.txt [--before-9fdebca]

The profiles come from the scenarios that take --profile (interference, engine_http,
engine_interference, disagg_path); bench/lib/profile_summary.py holds the rules.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.lib.profile_summary import BEFORE_9FDEBCA_RULES, ENGINE_RULES, summarize


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("profiles", nargs="+", type=Path, help="py-spy raw files (--format raw --threads)")
    p.add_argument("--before-9fdebca", action="store_true", help="profiles of the engine as of commit 9fdebca")


def run(args: argparse.Namespace) -> dict:
    rules = BEFORE_9FDEBCA_RULES if args.before_9fdebca else ENGINE_RULES
    result = {}
    for path in args.profiles:
        s = result[path.name] = summarize(path, rules)
        print(f"{path.name}: {s['samples']} samples")
        for k, v in s["threads"].items():
            print(f"  {k:48s} {100 * v:5.1f}%")
        for k, v in s["engine"].items():
            print(f"    {k:46s} {100 * v:5.1f}% of the engine thread")
    return {"profiles": result}
