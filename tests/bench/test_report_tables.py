"""The generated BENCHMARKS.md section, the strict JSON and the /metrics parsing."""

import json
import math

import pytest

from bench.lib.compare import compare, targets
from bench.lib.interference_report import SECTION, results_markdown, summary_json
from bench.lib.metrics import RequestRecord, summarize
from bench.lib.results import json_safe
from bench.lib.scrape import parse_prometheus
from bench.lib.tables import fmt_ratio, fmt_s, md_table, replace_section


def test_formatting():
    assert fmt_s(0.0234) == "23 ms" and fmt_s(1.5) == "1.50 s" and fmt_s(math.nan) == "–"
    assert fmt_ratio({"median": 0.5, "min": 0.4, "max": 0.7, "n": 3}) == "0.50 [0.40–0.70]"
    assert fmt_ratio({"median": 2.0, "min": 2.0, "max": 2.0, "n": 1}) == "2.00"
    assert fmt_ratio({"median": math.nan, "min": math.nan, "max": math.nan, "n": 0}) == "–"
    assert md_table(["a", "b"], [["1", "2"]]) == "| a | b |\n|---|---|\n| 1 | 2 |"


def test_replace_section_keeps_prose_and_is_idempotent():
    (BEGIN, END), HEADING = SECTION.markers, SECTION.heading
    doc = "# Benchmarks\n\nprose before\n"
    once = replace_section(doc, "TABLE 1", BEGIN, END, HEADING)
    assert "prose before" in once and "TABLE 1" in once and once.count(BEGIN) == 1
    twice = replace_section(once + "\nprose after\n", "TABLE 2", BEGIN, END, HEADING)
    assert "TABLE 1" not in twice and "TABLE 2" in twice and "prose after" in twice
    assert twice.count(BEGIN) == 1 and twice.count(END) == 1


def test_json_safe_makes_strict_json():
    text = json.dumps(json_safe({"a": math.nan, "b": [1.0, math.inf], "c": {"d": 2}}), allow_nan=False)
    assert json.loads(text) == {"a": None, "b": [1.0, None], "c": {"d": 2}}


def _run(arm: str, rep: int, gap: float, ttft: float = 0.5) -> dict:
    recs = [RequestRecord(i, 100, 3, send_s=float(i), chunk_times_s=[i + ttft, i + ttft + gap, i + ttft + 2 * gap],
                          end_s=i + ttft + 2 * gap, completion_tokens=3, text=f"t{i}") for i in range(4)]
    sm = summarize(recs)
    sm.update(kv_bytes_per_request=math.nan, handoff_s_per_request=math.nan, router_cpu_cores=0.1,
              loadgen_cpu_cores=0.05, other_cpu_cores=0.2, worker_cpu_cores={"w0": 0.5}, text_mismatches=0)
    return {"workload": "w", "rep": rep, "arm": arm, "summary": sm, "routes": {"disaggregated": 4.0},
            "records": [r.to_dict() for r in recs]}


ARMS = {
    "disagg": {"disaggregated": True, "dtype": "bfloat16", "description": "disaggregated"},
    "colo-a": {"disaggregated": False, "dtype": "bfloat16", "description": "colocated a"},
    "colo-b": {"disaggregated": False, "dtype": "bfloat16", "description": "colocated b"},
    "colo-fp32": {"disaggregated": False, "dtype": "float32", "description": "another dtype"},
}


def _runs() -> list[dict]:
    # Repetition 0: colo-a has the shorter gaps, colo-b the shorter TTFT; repetition 1: colo-b both.
    # colo-fp32 beats everything but is another dtype, so it is never the reference.
    return [_run("disagg", 0, 0.02, ttft=0.6), _run("colo-a", 0, 0.04, ttft=0.5), _run("colo-b", 0, 0.08, ttft=0.3),
            _run("colo-fp32", 0, 0.001, ttft=0.01),
            _run("disagg", 1, 0.02, ttft=0.6), _run("colo-a", 1, 0.10, ttft=0.5), _run("colo-b", 1, 0.05, ttft=0.4)]


def test_compare_takes_the_best_colocated_arm_of_the_same_dtype_per_metric_and_repetition():
    c = compare(_runs(), ARMS)
    assert list(c) == ["disagg"] and c["disagg"]["against"] == ["colo-a", "colo-b"]
    itl = c["disagg"]["ratios"]["itl.p50"]
    assert (itl["min"], itl["max"], itl["n"]) == pytest.approx((0.4, 0.5, 2))  # 0.02/0.04 and 0.02/0.05
    ttft = c["disagg"]["ratios"]["ttft.p50"]
    assert (ttft["min"], ttft["max"]) == pytest.approx((1.5, 2.0))  # 0.6/0.4 and 0.6/0.3
    tok = c["disagg"]["ratios"]["output_tokens_per_s"]
    # Higher is better there: the reference is the colocated arm that finished soonest (colo-b, 3.46 s
    # and 3.5 s from first send to last token, against disagg's 3.64 s), not the slowest (colo-a).
    assert (tok["min"], tok["max"]) == pytest.approx((3.46 / 3.64, 3.5 / 3.64))
    assert c["disagg"]["best_colocated"]["ttft.p50"] == "colo-b"


def test_targets_mark_met_and_missed_with_the_factor():
    runs = _runs()
    rows = {(t["target"]): t for t in targets(runs, ARMS, compare(runs, ARMS))}
    assert rows["itl.p50 disaggregated / best colocated"]["met"]  # 0.45 <= 1.1
    assert rows["itl.p99 disaggregated / best colocated"]["met"]  # 0.45 <= 0.5
    ttft = rows["ttft.p50 disaggregated / best colocated"]
    assert not ttft["met"] and ttft["factor"] == pytest.approx(1.75 / 1.15)
    assert not rows["ttft.p50"]["met"] and rows["ttft.p50"]["measured"] == pytest.approx(0.6)  # > 0.25 s
    assert rows["itl.p99"]["met"]  # 20 ms <= 30 ms


def test_the_peer_is_compared_per_repetition_but_never_taken_as_a_colocated_arm():
    arms = {**ARMS, "vllm": {"disaggregated": False, "peer": True, "dtype": "bfloat16", "description": "vLLM"}}
    # vLLM has the shortest gaps of all: were it a colocated candidate, it would be the reference
    runs = [*_runs(), _run("vllm", 0, 0.01, ttft=0.2), _run("vllm", 1, 0.04, ttft=0.3)]
    c = compare(runs, arms)["disagg"]
    assert c["against"] == ["colo-a", "colo-b"]
    assert c["ratios"]["itl.p50"]["min"] == pytest.approx(0.4)
    peer = c["peers"]["vllm"]
    assert (peer["itl.p50"]["min"], peer["itl.p50"]["max"]) == pytest.approx((0.5, 2.0))  # 0.02/0.04, 0.02/0.01
    assert (peer["ttft.p50"]["min"], peer["ttft.p50"]["max"]) == pytest.approx((2.0, 3.0))
    rows = {t["target"]: t for t in targets(runs, arms, compare(runs, arms))}
    assert not rows["ttft.p50 disaggregated / vllm"]["met"]  # 2.5 > 1.2
    assert rows["itl.p50 disaggregated / vllm"]["factor"] == pytest.approx(1.25)  # median 1.25 against 1.0


def test_markdown_and_committed_summary_from_a_synthetic_result():
    runs = _runs()
    result = {
        "started_utc": "20260101-000000", "wall_s": 60.0, "quick": False, "command": "python -m bench interference",
        "host": {"cpus": 2, "platform": "linux", "python": "3.11", "loadavg_at_start": [1.0, 1.0, 1.0],
                 "loadavg_at_end": [1.0, 1.0, 1.0]},
        "model": {"params": 4.16e7, "num_layers": 8, "hidden_size": 512, "num_heads": 8, "num_kv_heads": 4,
                  "intermediate_size": 1536, "vocab_size": 32000, "tie_word_embeddings": True},
        "workload": {"num_requests": 4, "rate": 0.6, "prompt_len": [300, 1000], "output_len": 3},
        "skipped_for_budget": ["colo-b rep 2"], "arms": ARMS, "runs": runs, "comparison": compare(runs, ARMS),
        "profiles": {"disagg": {"error": "py-spy not installed"}},
    }
    md = results_markdown(result)
    assert "| disagg | disaggregated | 600 ms |" in md and "| colo-b | colocated b |" in md
    assert "0.45 [0.40–0.50]" in md  # the ITL p50 ratio: median and range over the two repetitions
    assert "missed (1.52x the bound)" in md and "colo-b rep 2" in md and "py-spy not installed" in md
    assert "41.6M parameters" in md and "tied embeddings" in md
    summary = summary_json(result)
    assert all("records" not in r for r in summary["runs"]) and len(summary["targets"]) == 6
    json.dumps(summary, allow_nan=False)


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
    assert m["tandem_kv_transfer_seconds_count"] == 3.0
