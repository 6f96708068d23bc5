"""`python -m bench <scenario> [options]`: one entry point for every benchmark.

A scenario is a module bench/scenarios/<name>.py with a docstring (its help),
`add_arguments(parser)` and `run(args) -> dict`. The CLI adds the options every scenario shares,
runs it, and writes what `run` returned to bench/results/<scenario>/<run-id>.json (run-id: the UTC
start time), wrapped with the command, commit and host, and the load average sampled through the run
(bench/lib/results.py, bench/lib/load_sampler.py). Bulky outputs a
scenario keeps for itself (logs, per-request records, profiles) go under args.out_dir,
bench/out/<scenario>/<run-id>/, which is not committed.

    python -m bench                     # the scenarios, one line each
    python -m bench <scenario> --help
    python -m bench default             # what `make bench` runs: DEFAULT_SCENARIOS in turn

A concluded experiment is archived (ARCHIVED): its results stay in bench/results/ and its
conclusion in BENCHMARKS.md; its code is in git at the commit named, and `python -m bench <name>`
says how to get it back.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType

from bench.lib.load_sampler import LoadSampler
from bench.lib.results import BENCH_DIR, RESULTS_DIR, new_run_id, save_result

SCENARIOS_DIR = BENCH_DIR / "scenarios"
# `make bench` (python -m bench default): these command lines, in this order (about 85 minutes here).
DEFAULT_SCENARIOS: tuple[tuple[str, ...], ...] = (
    ("interference",),  # issue 13's load: disaggregated, colocated and vLLM (~25-35 min)
    ("plan_check",),  # tandem plan, calibrated now, against the interference run just measured (~5 min)
    ("engine_http", "--dtypes", "bfloat16"),  # decode throughput at 32 streams, with vLLM (~10 min)
    ("engine_decode", "--batches", "1", "--reps", "2"),  # the batch-1 step against the memory bound (~6 min)
    ("multiturn",),  # the prefix cache (~15 min)
    ("curves",),  # issue 23's curves: TTFT, ITL, throughput and the handoff against work, with vLLM (~6-13 min)
    ("prefill",),  # prefill throughput 128 to 8k tokens against transformers' forward (~8 min)
    ("chaos",),  # kills and restarts under load: nothing lost, nothing left (~15 min)
    ("summary",),  # issue 23's targets, Tandem beside vLLM, from the runs above (BENCHMARKS.md's head)
)
# Concluded experiments: name -> (the last commit holding bench/scenarios/<name>.py, where
# BENCHMARKS.md writes its conclusion).
ARCHIVED: dict[str, tuple[str, str]] = {
    "step_options": ("371d5ce", "The decode step and the first gap, investigated"),
    "sampling_overhead": ("371d5ce", "The OpenAI API's sampling extras"),
    "model_paths": ("371d5ce", "Two model paths: native against transformers"),
    "profile_summary": ("371d5ce", "The engine: one worker on one core (--profile summarizes in the run now)"),
    "migration": ("371d5ce", "Scale-down of decode: running streams migrate (measured)"),
    "engine_interference": ("371d5ce", "Chunked prefill per role"),
    "parity_probe": ("371d5ce", "The handoff parity probe: its cost, and the noise it must tolerate"),
    "kv_handoff": ("eec828c", "Cost against work: curves (the transports against the machine's bound)"),
    "kv_verify": ("eec828c", "Earlier measurements (the cost itself: worker/kv/README.md, 'Cost')"),
    "autoscale_sim": ("c54fddf", "Autoscaling: the planner against a fixed fleet and a ratio policy (with bench/simulator/)"),
    "calibrate": ("c54fddf", "What one replica can do (measured); tandem plan --save-calibration measures the same"),
    "tensor_parallel": ("c54fddf", "Tensor parallelism (issue 18)"),
    "disagg_path": ("882b042", "The first gap after a handoff (issue 23 point 3): what it is made of, not changed"),
    "loadgen": ("c54fddf", "Earlier measurements (a tool: bench/lib/loadgen.py drives every load)"),
    "operator_scale": ("1768a11", "The operator at scale (issue 21, Operations)"),
    "tp_memory": ("f741fcb", "Tensor parallelism on the transformers path: each rank's memory (issue 30, item 1)"),
}


def scenario_names() -> list[str]:
    """Every module of bench/scenarios/ (found by file, nothing imported)."""
    return sorted(p.stem for p in SCENARIOS_DIR.glob("*.py") if not p.stem.startswith("_"))


def summary_line(name: str, width: int = 100) -> str:
    """The first sentence of a scenario's docstring on one line, read without importing it (torch
    stays unloaded)."""
    doc = ast.get_docstring(ast.parse((SCENARIOS_DIR / f"{name}.py").read_text())) or ""
    first = " ".join(doc.strip().split("\n\n")[0].split())
    sentence = first.split(". ")[0].rstrip(".")
    return (sentence if len(sentence) <= width else sentence[: width - 1] + "…") or "(no docstring)"


def load(name: str) -> ModuleType:
    module = importlib.import_module(f"bench.scenarios.{name}")
    for attr in ("add_arguments", "run"):
        if not callable(getattr(module, attr, None)):
            raise TypeError(f"bench/scenarios/{name}.py has no {attr}(): every scenario needs "
                            "add_arguments(parser) and run(args) -> dict")
    return module


def build_parser(name: str, module: ModuleType) -> argparse.ArgumentParser:
    """The scenario's parser: its own options plus the ones every scenario has."""
    p = argparse.ArgumentParser(prog=f"python -m bench {name}", description=module.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    common = p.add_argument_group("every scenario")
    common.add_argument("--run-id", default=None, help="the run's name (default: the UTC start time)")
    common.add_argument("--results-dir", type=Path, default=RESULTS_DIR,
                        help="results go to RESULTS_DIR/<scenario>/<run-id>.json (default: %(default)s)")
    common.add_argument("--no-save", action="store_true", help="print the result, write no result file")
    module.add_arguments(p)
    return p


def run_scenario(name: str, argv: list[str]) -> int:
    module = load(name)
    args = build_parser(name, module).parse_args(argv)
    args.scenario = name
    args.run_id = args.run_id or new_run_id()
    args.out_dir = BENCH_DIR / "out" / name / args.run_id
    args.out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    args.load = LoadSampler().start()  # a scenario may quote args.load.summary() in its tables
    try:
        result = module.run(args)
    finally:
        sampled = args.load.stop()
    # A scenario that checks something (text identical, nothing lost) says ok: false when it failed.
    code = 1 if result.get("ok") is False else 0
    if args.no_save:
        print(f"{name}: done in {time.monotonic() - t0:.0f} s (not saved)")
        return code
    path = save_result(args.results_dir, name, args.run_id, result, argv, time.monotonic() - t0, sampled)
    print(f"{name}: wrote {path}" + (" (ok: false)" if code else ""))
    return code


def run_defaults() -> int:
    """Every default scenario with its defaults; one failing does not stop the others."""
    failed = []
    for name, *argv in DEFAULT_SCENARIOS:
        print(f"=== python -m bench {' '.join([name, *argv])}", flush=True)
        try:
            if run_scenario(name, argv):
                failed.append(name)
        except Exception:  # noqa: BLE001 - reported, and the next scenario still runs
            traceback.print_exc()
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def usage() -> str:
    width = max(map(len, scenario_names()), default=8)
    lines = [__doc__.strip(), "", "scenarios:"]
    lines += [f"  {n:{width}s}  {summary_line(n)}" for n in scenario_names()]
    lines += ["", "default (make bench): " + "; ".join(" ".join(d) for d in DEFAULT_SCENARIOS)]
    lines += ["archived (results and conclusions kept): " + ", ".join(ARCHIVED)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name == "default":
        return run_defaults()
    if name in ARCHIVED:
        commit, section = ARCHIVED[name]
        print(f"{name} is archived: its results are in bench/results/{name}/, its conclusion in BENCHMARKS.md "
              f"({section!r}); its code: git show {commit}:bench/scenarios/{name}.py", file=sys.stderr)
        return 2
    if name not in scenario_names():
        print(f"unknown scenario {name!r}; choose from: {', '.join(scenario_names())}", file=sys.stderr)
        return 2
    return run_scenario(name, rest)
