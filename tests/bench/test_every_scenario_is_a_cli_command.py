"""`python -m bench <scenario>`: every module of bench/scenarios/ imports, says what it measures and
parses --help; the CLI lists them, runs one and writes its result file with the envelope."""

import json
import subprocess
import sys

import pytest

from bench.cli import (
    ARCHIVED,
    DEFAULT_SCENARIOS,
    build_parser,
    load,
    main,
    scenario_names,
    summary_line,
)
from bench.lib.pyspy import summarize
from bench.lib.results import ENVELOPE_KEYS, ROOT, read_result, result_files

SCENARIOS = scenario_names()


def test_the_scenarios_folder_holds_every_benchmark():
    assert {"interference", "multiturn", "engine_http", "curves", "chaos"} <= set(SCENARIOS)
    assert {d[0] for d in DEFAULT_SCENARIOS} <= set(SCENARIOS)
    assert not set(ARCHIVED) & set(SCENARIOS), "an archived scenario's code is gone from bench/scenarios/"


@pytest.mark.parametrize("line", DEFAULT_SCENARIOS, ids=lambda d: d[0])
def test_every_default_command_line_parses(line):
    name, *argv = line
    build_parser(name, load(name)).parse_args(argv)


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_imports_has_a_docstring_and_parses_help(name, capsys):
    module = load(name)
    assert module.__doc__ and module.__doc__.strip(), f"bench/scenarios/{name}.py has no docstring"
    parser = build_parser(name, module)
    with pytest.raises(SystemExit) as stop:
        parser.parse_args(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert f"python -m bench {name}" in out and module.__doc__.strip().splitlines()[0] in out and "--results-dir" in out
    assert summary_line(name) and len(summary_line(name)) <= 100


def test_without_a_scenario_the_cli_lists_them_all(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for name in SCENARIOS:
        assert f"  {name} " in out


def test_an_unknown_scenario_is_refused_with_the_choices(capsys):
    assert main(["no-such-scenario"]) == 2
    assert "interference" in capsys.readouterr().err


def test_an_archived_scenario_says_where_its_code_and_results_are(capsys):
    assert main(["step_options"]) == 2
    err = capsys.readouterr().err
    assert "bench/results/step_options/" in err and "git show " in err and "bench/scenarios/step_options.py" in err


def test_a_run_writes_its_result_under_scenario_and_run_id(tmp_path):
    cmd = [sys.executable, "-m", "bench", "summary", "--no-markdown", "--run-id", "20260101-000000",
           "--results-dir", str(tmp_path / "results")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    path = tmp_path / "results" / "summary" / "20260101-000000.json"
    doc = json.loads(path.read_text())
    assert tuple(doc) == ENVELOPE_KEYS and doc["scenario"] == "summary"
    assert doc["command"].startswith("python -m bench summary") and doc["host"]["cpus"]
    assert doc["result"]["runs"]["interference"] and doc["result"]["targets"]
    # read back by run id, and as the newest of its scenario once a later run exists
    assert read_result("summary", "20260101-000000", tmp_path / "results") == doc
    later = tmp_path / "results" / "summary" / "20260102-000000.json"
    later.write_text(json.dumps(doc | {"run_id": "20260102-000000"}))
    assert read_result("summary", None, tmp_path / "results")["run_id"] == "20260102-000000"


def test_a_py_spy_profile_is_summarized_by_thread_and_engine_work(tmp_path):
    profile = tmp_path / "worker.txt"
    profile.write_text("thread (0x1): tandem-engine;step (engine.py:10);sample (sampling.py:5) 30\n"
                       "thread (0x2): MainThread;run (base_events.py:1);EpollSelector.select (selectors.py:468) 10\n")
    summary = summarize(profile)
    assert summary["samples"] == 40 and summary["engine"] == {"sampling": 1.0}
    assert summary["threads"] == {"engine thread": 0.75, "HTTP event loop: waiting": 0.25}


@pytest.mark.parametrize("scenario", sorted({p.parent.name for p in (ROOT / "bench" / "results").glob("*/*.json")}))
def test_committed_results_are_named_by_scenario_and_run(scenario):
    assert scenario in SCENARIOS or scenario in ARCHIVED, f"bench/results/{scenario}/ belongs to no scenario"
    for path in result_files(scenario):
        doc = json.loads(path.read_text())
        assert tuple(doc) == ENVELOPE_KEYS and doc["scenario"] == scenario and doc["run_id"] == path.stem
