"""bench summary: issue 23's targets read from each scenario's result, with the bound each is held
to, met or missed, and a scenario not run shown as such (pure)."""

from bench.lib.summary_report import section, target_rows


def env(scenario: str, result: dict) -> dict:
    return {"scenario": scenario, "run_id": "20261202-000000", "wall_s": 60.0, "commit": "abc",
            "host": {"loadavg_during": {"median": 2.1}}, "result": result}


def spread(v: float) -> dict:
    return {"median": v, "min": v * 0.9, "max": v * 1.1, "n": 2}


def summary(ttft: float, itl: float, itl99: float, first: float) -> dict:
    return {"ttft": {"p50": ttft}, "itl": {"p50": itl, "p99": itl99, "max": itl99 * 2}, "first_gap": {"p50": first}}


RESULTS = {
    "interference": env("interference", {
        "comparison": {"disagg-bf16": {"peers": {"vllm-bf16": {
            "ttft.p50": spread(1.1), "itl.p50": spread(1.3), "itl.p99": spread(0.6)}}}},
        "runs": [{"arm": "disagg-bf16", "summary": summary(0.3, 0.020, 0.05, 0.050)},
                 {"arm": "disagg-bf16", "summary": summary(0.4, 0.020, 0.06, 0.030)},
                 {"arm": "vllm-bf16", "summary": summary(0.2, 0.015, 0.09, 0.02)}]}),
    "engine_http": env("engine_http", {"summary": {"bfloat16": {
        "tandem": {"tokens_per_s": spread(900.0)}, "vllm": {"tokens_per_s": spread(1200.0)}}}}),
    "engine_decode": env("engine_decode", {
        "bandwidth": {"read_bytes_per_s": 4e9}, "bandwidth_after": {"read_bytes_per_s": 8e9},
        "dtypes": {"bfloat16": {"batches": {"1": {"tandem_step_s": [0.012, 0.013, 0.020], "bound_s": 0.02}}}}}),
    "curves": env("curves", {"arms": {"vllm-bf16": {"ttft": {"2048": {"ttft_p50": 0.4}}},
                                      "colo2-c128-bf16": {"ttft": {"2048": {"ttft_p50": 0.5}}},
                                      "disagg-bf16": {"ttft": {"2048": {"ttft_p50": 0.8}}}}}),
    "plan_check": None, "prefill": None,
}


def test_each_target_is_held_to_its_bound():
    rows = {r.target: r for r in target_rows(RESULTS)}
    ttft = rows["interference load: disaggregated TTFT p50 / vLLM's"]
    assert (ttft.measured, ttft.met) == (1.1, True)  # bound 1.2
    assert rows["interference load: disaggregated ITL p50 / vLLM's"].met is False  # 1.3 > 1
    assert rows["interference load: disaggregated ITL p99 / vLLM's"].met is True  # 0.6 <= 0.7
    worst = rows["interference load: disaggregated ITL max / vLLM's (no target)"]
    assert abs(worst.measured - 0.11 / 0.18) < 1e-9 and worst.met is None  # shown, held to nothing
    first = rows["first gap after a handoff / median gap (disaggregated)"]
    assert abs(first.measured - 2.0) < 1e-9 and first.met is True  # median(50, 30) ms / 20 ms
    tput = rows["decode throughput, 32 streams over HTTP: Tandem / vLLM"]
    assert abs(tput.measured - 0.75) < 1e-9 and tput.met is False
    # the bound at the better bandwidth (8 GB/s): 0.02 s * 4/8 = 10 ms; median step 13 ms
    b1 = rows["batch-1 decode step / memory bound, bfloat16"]
    assert abs(b1.measured - 1.3) < 1e-9 and b1.met is False
    colo = rows["prefill at 2048 tokens (colocated): Tandem / vLLM tokens/s"]
    assert abs(colo.measured - 0.8) < 1e-9 and colo.met is False
    assert not any(r.target.startswith("tandem plan") for r in rows.values())  # plan_check not run


def test_section_names_every_run_and_what_was_not_run():
    text = section(RESULTS)
    assert "`interference` | `20261202-000000`" in text
    assert "`plan_check` | not run" in text
    assert "| disagg-bf16 | 350 ms [300–400] | 20 ms |" in text
    assert "**met**" in text and "missed" in text


def test_a_missing_peer_is_not_measured_rather_than_met():
    rows = target_rows({"interference": env("interference", {"comparison": {}, "runs": []})})
    assert all(r.measured is None and r.met is None for r in rows if r.target.startswith("interference"))
