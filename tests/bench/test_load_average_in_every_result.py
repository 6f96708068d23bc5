"""Every result records how busy the shared cores were through its run: the CLI samples the load
average while the scenario runs and keeps it in the envelope's host; reports quote it."""

import argparse
import json
import subprocess
import sys
import threading

from bench.lib.load_sampler import LoadSampler, load_phrase, summarize_load
from bench.lib.results import ROOT, scenario_settings


def test_the_summary_is_min_median_max_of_the_one_minute_average():
    s = summarize_load([(0.0, 3.0), (10.0, 1.0), (20.0, 8.5), (30.0, 2.0)])
    assert s == {"samples": 4, "min": 1.0, "median": 2.5, "max": 8.5}
    assert summarize_load([]) == {"samples": 0, "min": None, "median": None, "max": None}


def test_the_phrase_says_the_range_and_median_and_nothing_without_samples():
    assert load_phrase({"samples": 3, "min": 1.04, "median": 2.0, "max": 13.96}) == \
        "load average 1.0-14.0 (median 2.0)"
    assert load_phrase(None) == "" and load_phrase(summarize_load([])) == ""


def test_the_sampler_reads_until_stopped_and_once_more_at_the_end():
    loads = iter([1.0, 2.0, 3.0, 4.0, 5.0])
    read_twice = threading.Event()
    calls = []

    def read():
        calls.append(1)
        if len(calls) >= 2:
            read_twice.set()
        return (next(loads), 0.0, 0.0)

    sampler = LoadSampler(every_s=0.01, read=read).start()
    assert read_twice.wait(5)
    out = sampler.stop()
    n = len(calls)
    assert out["samples"] == n == len(out["series"]) and out["max"] == float(n) and out["min"] == 1.0
    assert [t for t, _ in out["series"]] == sorted(t for t, _ in out["series"])
    assert not sampler._thread.is_alive() and len(calls) == n  # nothing read after stop()


def test_a_saved_result_carries_the_load_sampled_through_its_run(tmp_path):
    cmd = [sys.executable, "-m", "bench", "summary", "--no-markdown", "--run-id", "20260101-000000",
           "--results-dir", str(tmp_path / "results")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    doc = json.loads((tmp_path / "results" / "summary" / "20260101-000000.json").read_text())
    during = doc["host"]["loadavg_during"]
    assert during["samples"] >= 2 and during["min"] <= during["median"] <= during["max"]
    assert len(during["series"]) == during["samples"]


def test_a_scenarios_settings_leave_out_what_the_cli_added():
    args = argparse.Namespace(duration_s=600.0, spare=["decode-0"], load=LoadSampler(), out_dir="x",
                              results_dir="y", no_save=False, run_id="r", scenario="chaos")
    assert scenario_settings(args) == {"duration_s": 600.0, "spare": ["decode-0"]}
