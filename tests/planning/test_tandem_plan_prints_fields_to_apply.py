"""`tandem plan` prints InferenceService fields that the operator's own spec parser accepts, with the
figures behind them as comments; a malformed workload gets a clear error, an impossible one exit 1."""

from __future__ import annotations

import json

import pytest
import yaml
from tandem.cli.main import main
from tandem.operator.autoscaling.spec import AutoscalingSpec
from tandem.operator.spec import InferenceServiceSpec

CALIBRATION = {
    "prefill_seconds": {"128": 0.128, "1024": 1.024},
    "decode_step_seconds": {"1": 0.01, "8": 0.02, "32": 0.05},
    "fit": {"prefill_overhead_s": 0.0, "prefill_tokens_per_s": 1000.0},
}
LOAD = ["--rate", "4", "--prompt-tokens", "200-600", "--output-tokens", "50", "--ttft", "1", "--itl", "0.05",
        "--requests", "600"]


@pytest.fixture
def calibration(tmp_path):
    path = tmp_path / "worker.json"
    path.write_text(json.dumps(CALIBRATION))
    return str(path)


def test_the_printed_fields_parse_as_an_inference_service_with_autoscaling(calibration, capsys):
    assert main(["plan", "--calibration", calibration, *LOAD, "--autoscaling"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# tandem plan: 4 requests/s") and "# recommended:" in out
    fields = yaml.safe_load(out)["spec"]
    spec = InferenceServiceSpec.from_dict({"model": {"path": "/m"}, **fields})
    assert spec.prefill.replicas == fields["prefill"]["replicas"] >= 2
    assert spec.decode.engine.prefill_chunk_tokens == fields["decode"]["engine"]["prefillChunkTokens"]
    scaling = AutoscalingSpec.from_dict(fields["autoscaling"])
    assert scaling.itl.seconds == 0.05 and scaling.prefill.max_replicas == 2 * spec.prefill.replicas


def test_a_workload_file_and_flags_combine_flags_winning(calibration, tmp_path, capsys):
    wl = tmp_path / "workload.yaml"
    wl.write_text("rate: 100\nprompt: 200-600\noutput: 50\ntargets: {ttft: {seconds: 1}, itl: {seconds: 0.05}}\n")
    assert main(["plan", "--calibration", calibration, "--workload", str(wl), "--rate", "4", "--requests", "600"]) == 0
    assert "# tandem plan: 4 requests/s" in capsys.readouterr().out


def test_fleet_predicts_one_given_fleet(calibration, capsys):
    assert main(["plan", "--calibration", calibration, *LOAD, "--fleet", "0+3", "--decode-chunk", "32"]) == 0
    out = capsys.readouterr().out
    assert "# colocated: 3 colocated workers, prompts prefilled 32 tokens a step" in out
    assert "# predicted: TTFT p50" in out


@pytest.mark.parametrize("argv, words", [
    (["--prompt-tokens", "10-5"], "prompt: '10-5' is not a length"),
    (["--fleet", "one"], "--fleet 'one': write PREFILL+DECODE"),
])
def test_malformed_input_is_refused_with_exit_2_and_a_message(calibration, capsys, argv, words):
    assert main(["plan", "--calibration", calibration, *LOAD, *argv]) == 2
    assert words in capsys.readouterr().err


def test_without_a_capacity_it_says_how_to_give_one(capsys):
    assert main(["plan", *LOAD]) == 2
    assert "--calibration FILE or --model DIR" in capsys.readouterr().err


def test_targets_no_fleet_can_meet_exit_1_with_nothing_to_apply(calibration, capsys):
    assert main(["plan", "--calibration", calibration, "--rate", "1", "--prompt-tokens", "3000",
                 "--output-tokens", "8", "--ttft", "1"]) == 1
    out = capsys.readouterr().out
    assert "more workers cannot help" in out and "spec:" not in out


def test_it_measures_a_model_saves_the_calibration_and_plans_from_it(toy_model_dir, tmp_path, capsys):
    saved = tmp_path / "measured.json"
    argv = ["plan", "--model", str(toy_model_dir), "--dtype", "float32", "--compile", "off",
            "--save-calibration", str(saved), "--rate", "1", "--prompt-tokens", "50-100", "--output-tokens", "16",
            "--ttft", "2", "--itl", "0.5", "--requests", "300"]
    assert main(argv) == 0
    measured = json.loads(saved.read_text())
    assert measured["dtype"] == "float32" and len(measured["decode_step_seconds"]) == 32
    assert measured["fit"]["prefill_tokens_per_s"] > 0
    assert "capacity (measured now:" in capsys.readouterr().out
