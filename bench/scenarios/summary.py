"""Issue 23's targets, Tandem beside vLLM, from the latest result of each scenario `make bench` ran:
a table of the runs it read, each target with its bound and measured ratio, and the interference
arms; written into BENCHMARKS.md's summary section.

    python -m bench summary [--run SCENARIO=RUN_ID ...] [--no-markdown]

`make bench` runs it last, so the section names the runs of that sitting; --run picks an older one.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict

from bench.lib.tables import Section

SCENARIOS = ("interference", "plan_check", "engine_http", "engine_decode", "curves", "prefill")
SECTION = Section("summary", "python -m bench summary", "## Tandem beside vLLM: issue 23's targets from one `make bench` run")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--run", action="append", default=[], metavar="SCENARIO=RUN_ID",
                    help="read this run of a scenario instead of its latest")
    ap.add_argument("--no-markdown", action="store_true", help="print the section; leave BENCHMARKS.md as it is")


def chosen_results(picks: list[str]) -> dict[str, dict | None]:
    from bench.lib.results import read_result

    chosen = dict(p.split("=", 1) for p in picks)
    if unknown := sorted(set(chosen) - set(SCENARIOS)):
        raise SystemExit(f"--run {unknown[0]}=...: the summary reads {', '.join(SCENARIOS)}")
    return {name: read_result(name, chosen.get(name)) for name in SCENARIOS}


def run(args: argparse.Namespace) -> dict:
    from bench.lib.summary_report import section, target_rows

    results = chosen_results(args.run)
    text = section(results)
    print(text)
    if not args.no_markdown:
        SECTION.write(text)
    return {"runs": {k: (v["run_id"] if v else None) for k, v in results.items()},
            "targets": [asdict(r) for r in target_rows(results)]}
