"""A workload is written the way people say it (512, 300-1000, lognormal:500:0.8, a list of observed
lengths; targets as spec.autoscaling writes them), and anything else is refused by name."""

from __future__ import annotations

import random

import pytest
from tandem.planning.workload import Workload, parse_lengths


def test_each_length_form_draws_within_its_range():
    rng = random.Random(0)
    assert {parse_lengths(512, "prompt").draw(rng) for _ in range(20)} == {512}
    uniform = [parse_lengths("300-1000", "prompt").draw(rng) for _ in range(2000)]
    assert min(uniform) >= 300 and max(uniform) <= 1000 and 600 < sum(uniform) / len(uniform) < 700
    capped = [parse_lengths("lognormal:500:1.5:2000", "prompt").draw(rng) for _ in range(2000)]
    assert max(capped) == 2000 and min(capped) >= 1
    assert {parse_lengths([10, 20], "output").draw(rng) for _ in range(200)} == {10, 20}


def test_quantiles_and_means_of_the_simple_forms_are_exact():
    uniform = parse_lengths("300-1000", "prompt")
    assert uniform.quantile(0.9) == pytest.approx(930) and uniform.mean() == 650
    assert parse_lengths("lognormal:500:0.5", "p").quantile(0.5) == pytest.approx(500, rel=0.05)


@pytest.mark.parametrize("bad", ["0", "10-5", "lognormal:500", "lognormal:0:1", "many", [], [3, 0]])
def test_a_malformed_length_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="^prompt: "):
        parse_lengths(bad, "prompt")


def test_a_workload_file_reads_like_spec_autoscaling_targets():
    wl = Workload.from_dict({"rate": 2, "prompt": "100-200", "output": 64,
                             "targets": {"ttft": {"seconds": 0.5}, "itl": {"seconds": 0.05, "percentile": 99}}})
    assert (wl.ttft.seconds, wl.ttft.percentile, wl.itl.seconds, wl.itl.percentile) == (0.5, 90, 0.05, 99)
    assert wl.within(0.9).itl.seconds == pytest.approx(0.045) and wl.within(0.9).itl.percentile == 99


@pytest.mark.parametrize("d, words", [
    ({"prompt": 1, "output": 1}, "rate is required"),
    ({"rate": 0, "prompt": 1, "output": 1}, "rate must be above 0"),
    ({"rate": 1, "prompt": 1, "output": 1, "burst": 3}, "unknown keys"),
    ({"rate": 1, "prompt": 1, "output": 1, "targets": {"itl": {"seconds": 0.1, "percentile": 40}}}, "targets.itl"),
])
def test_a_malformed_workload_is_refused_saying_what_is_wrong(d, words):
    with pytest.raises(ValueError, match=words):
        Workload.from_dict(d)


def test_the_trace_is_poisson_at_the_rate_and_reproducible():
    wl = Workload.from_dict({"rate": 5, "prompt": "100-200", "output": 8})
    a, b = list(wl.trace(400.0, seed=3)), list(wl.trace(400.0, seed=3))
    assert a == b and abs(len(a) - 2000) < 4 * 2000 ** 0.5
    assert all(100 <= r.prompt <= 200 and r.output == 8 for r in a)
