"""The generated BENCHMARKS.md section, the strict JSON and the /metrics parsing."""

import json
import math

from bench.metrics import RequestRecord, make_slos, summarize
from bench.report import (
    BEGIN,
    END,
    fmt_ratio,
    fmt_s,
    json_safe,
    md_table,
    replace_section,
    results_markdown,
)
from bench.run import ratios
from bench.scrape import delta, parse_prometheus


def test_formatting():
    assert fmt_s(0.0234) == "23 ms" and fmt_s(1.5) == "1.50 s" and fmt_s(math.nan) == "–"
    assert fmt_ratio({"median": 0.5, "min": 0.4, "max": 0.7, "n": 3}) == "0.50 [0.40–0.70]"
    assert fmt_ratio({"median": 2.0, "min": 2.0, "max": 2.0, "n": 1}) == "2.00"
    assert fmt_ratio({"median": math.nan, "min": math.nan, "max": math.nan, "n": 0}) == "–"
    assert md_table(["a", "b"], [["1", "2"]]) == "| a | b |\n|---|---|\n| 1 | 2 |"


def test_replace_section_keeps_prose_and_is_idempotent():
    doc = "# Benchmarks\n\nprose before\n"
    once = replace_section(doc, "TABLE 1")
    assert "prose before" in once and "TABLE 1" in once and once.count(BEGIN) == 1
    twice = replace_section(once + "\nprose after\n", "TABLE 2")
    assert "TABLE 1" not in twice and "TABLE 2" in twice and "prose after" in twice
    assert twice.count(BEGIN) == 1 and twice.count(END) == 1


def test_json_safe_makes_strict_json():
    text = json.dumps(json_safe({"a": math.nan, "b": [1.0, math.inf], "c": {"d": 2}}), allow_nan=False)
    assert json.loads(text) == {"a": None, "b": [1.0, None], "c": {"d": 2}}


def _run(arm: str, rep: int, gap: float, slos) -> dict:
    recs = [RequestRecord(i, 100, 3, send_s=float(i), chunk_times_s=[i + 0.5, i + 0.5 + gap, i + 0.5 + 2 * gap],
                          end_s=i + 0.5 + 2 * gap, completion_tokens=3) for i in range(4)]
    sm = summarize(recs, slos)
    sm.update(kv_bytes_per_request=math.nan, handoff_s_per_request=math.nan, handoff_share_of_ttft=math.nan,
              router_cpu_cores=0.1, loadgen_cpu_cores=0.05, text_mismatches=0)
    return {"workload": "w", "rep": rep, "arm": arm, "summary": sm,
            "records": [r.to_dict() for r in recs]}


def test_ratios_and_markdown_from_a_synthetic_result():
    slos = make_slos(1.0, 0.05)
    runs = [_run("colocated", 0, 0.25, slos), _run("disagg-tcp", 0, 0.125, slos),
            _run("colocated", 1, 0.25, slos), _run("disagg-tcp", 1, 0.0625, slos)]
    r = ratios(runs, [s.name for s in slos])
    itl = r["w|disagg-tcp"]["itl.p50"]
    assert (itl["min"], itl["max"], itl["n"]) == (0.25, 0.5, 2)
    result = {
        "started_utc": "20260101-000000", "wall_s": 60.0, "quick": False,
        "host": {"cpus": 2, "platform": "linux", "python": "3.11", "loadavg_at_end": [1.0, 1.0, 1.0]},
        "model": {"params": 4e7, "num_layers": 8, "hidden_size": 512, "num_heads": 8,
                  "num_kv_heads": 4, "dtype": "float32", "kv_bytes_per_token": 16384},
        "arms": ["colocated", "disagg-tcp"], "idle_cpu_cores": {"colocated": 0.0},
        "calibration": {"isolated_prefill_s": 1.0, "isolated_prefill_tokens": 1024,
                        "isolated_step_s": 0.05, "capacity_rps": 1.0},
        "slos": [{"name": s.name} for s in slos],
        "workloads": [{"name": "w", "mode": "poisson", "num_requests": 4, "rate": 0.5}],
        "runs": runs, "ratios": r,
    }
    md = results_markdown(result)
    assert "| w | disagg-tcp |" in md and "| w | colocated |" in md
    assert "0.38 [0.25–0.50]" in md  # the ITL p50 ratio: median and range over the two repetitions
    assert "16 KiB per token" in md


def test_parse_prometheus_sums_label_sets_and_skips_buckets():
    text = """# HELP tandem_kv_transfer_bytes_total KV bytes
# TYPE tandem_kv_transfer_bytes_total counter
tandem_kv_transfer_bytes_total{backend="tcp",direction="pull"} 1024.0
tandem_kv_transfer_bytes_total{backend="tcp",direction="serve"} 2048.0
tandem_kv_transfer_seconds_bucket{backend="tcp",direction="pull",le="0.1"} 3.0
tandem_kv_transfer_seconds_sum{backend="tcp",direction="pull"} 0.25
tandem_kv_transfer_seconds_count{backend="tcp",direction="pull"} 3.0
"""
    m = parse_prometheus(text)
    assert m["tandem_kv_transfer_bytes_total"] == 3072.0
    assert "tandem_kv_transfer_seconds_bucket" not in m
    assert delta({}, m, "tandem_kv_transfer_seconds_count") == 3.0
    assert delta(m, m, "tandem_kv_transfer_seconds_sum") == 0.0


def test_kv_from_health_takes_the_pull_side_delta_and_estimates_time():
    from bench.scrape import kv_from_health

    before = {"bytes_total": {"pull": 1000}, "transfers_total": {"pull": 2}}
    after = {"bytes_total": {"pull": 5000, "serve": 99}, "transfers_total": {"pull": 4},
             "recent_bandwidth_bytes_per_second": 2000.0}
    kv = kv_from_health(before, after)
    assert (kv["bytes"], kv["count"], kv["seconds"]) == (4000.0, 2.0, 2.0)
    assert math.isnan(kv_from_health({}, {"bytes_total": {"pull": 10}})["seconds"])
