"""bench plan_check: the interference arms map to the fleets they ran, each repetition's measured
figures are read, and each fleet's prediction is set beside them (the simulator, no processes)."""

from tandem.planning.calibrate import fitted
from tandem.planning.capacity import Capacity
from tandem.planning.workload import Workload

from bench.scenarios.plan_check import ARM_FLEETS, compare, measured


def _run(arm: str, rep: int, ttft: float, itl99: float) -> dict:
    return {"arm": arm, "rep": rep, "routes": {"disaggregated": 3},
            "summary": {"ttft": {"p50": ttft}, "itl": {"p50": itl99 / 4, "p99": itl99}}}


def _calibration(prefill_tok_s: float) -> dict:
    prefill = {str(n): 0.01 + n / prefill_tok_s for n in (128, 512, 1024)}
    decode = {str(b): 0.005 + 0.001 * b for b in (1, 8, 32)}
    return {"prefill_seconds": prefill, "decode_step_seconds": decode, "fit": fitted(prefill, decode)}


INTERFERENCE = {"result": {"runs": [
    _run("disagg-bf16", 0, 0.30, 0.040), _run("colo2-c128-bf16", 0, 0.25, 0.080),
    _run("vllm-bf16", 0, 0.12, 0.060), _run("disagg-bf16", 1, 0.34, 0.050), _run("disagg-fp32", 0, 0.5, 0.03),
    {"arm": "disagg-bf16", "rep": 2, "summary": None},  # a repetition that did not run
]}}


def test_measured_reads_tandem_arms_per_repetition():
    m = measured(INTERFERENCE)
    assert set(m) == {"disagg-bf16", "colo2-c128-bf16"}  # the peer has no Tandem fleet; fp32 is another dtype
    assert set(measured(INTERFERENCE, "float32")) == {"disagg-fp32"}
    assert m["disagg-bf16"]["ttft_p50"] == [0.30, 0.34]
    assert m["disagg-bf16"]["itl_p99"] == [0.040, 0.050]
    assert ARM_FLEETS["colo2-c128-bf16"] == (0, 2, 128)


def test_prediction_follows_the_calibration_and_sits_beside_the_measurement():
    wl = Workload.from_dict({"rate": 0.6, "prompt": "300-1000", "output": 64})
    m = measured(INTERFERENCE)
    fast = {r["arm"]: r for r in compare(Capacity.from_dict(_calibration(4000.0)), wl, 13, 40, m)}
    slow = {r["arm"]: r for r in compare(Capacity.from_dict(_calibration(800.0)), wl, 13, 40, m)}
    assert fast["disagg-bf16"]["fleet"] == "1 prefill + 1 decode workers (disagg-bf16)"
    assert fast["colo2-c128-bf16"]["fleet"].startswith("2 colocated workers")
    for arm in fast:
        assert slow[arm]["predicted"]["ttft_p50"] > fast[arm]["predicted"]["ttft_p50"]
        assert fast[arm]["measured"] is m[arm]
    # a prompt of 300-1000 tokens at 4000 tokens/s: TTFT p50 near 0.2 s; the ratio is against the
    # median of the measured repetitions
    r = fast["disagg-bf16"]
    assert 0.08 < r["predicted"]["ttft_p50"] < 0.6
    assert abs(r["ttft_p50_ratio"] - r["predicted"]["ttft_p50"] / 0.32) < 1e-9
