"""Seeded workloads: every arm must see the same requests at the same times."""

import statistics

import pytest

from bench.lib.workload import WorkloadSpec, make_prompt, plan, poisson_arrivals, prompt_lengths


def words_plus_bos(text: str) -> int:
    return len(text.split()) + 1


def test_poisson_arrivals_are_reproducible_and_increasing():
    a = poisson_arrivals(2.0, 50, seed=1)
    assert a == poisson_arrivals(2.0, 50, seed=1)
    assert a != poisson_arrivals(2.0, 50, seed=2)
    assert all(x < y for x, y in zip(a, a[1:], strict=False)) and a[0] > 0


def test_poisson_arrivals_have_the_requested_rate():
    a = poisson_arrivals(4.0, 4000, seed=3)
    gaps = [y - x for x, y in zip([0.0, *a], a, strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.05)
    # Exponential gaps: the standard deviation equals the mean.
    assert statistics.pstdev(gaps) == pytest.approx(0.25, rel=0.1)


def test_prompt_lengths_stay_in_range():
    lens = prompt_lengths(256, 1024, 200, seed=0)
    assert min(lens) >= 256 and max(lens) <= 1024
    assert len(set(lens)) > 50


def test_make_prompt_hits_the_target_token_count():
    for target in (2, 33, 512):
        p = make_prompt(words_plus_bos, target, seed=target)
        assert words_plus_bos(p) == target
    assert make_prompt(words_plus_bos, 40, 1) != make_prompt(words_plus_bos, 40, 2)


def test_plan_is_identical_for_the_same_spec_and_records_actual_lengths():
    spec = WorkloadSpec("w", "poisson", 5, (10, 20), 8, rate=1.0, seed=7)
    a, b = plan(spec, words_plus_bos), plan(spec, words_plus_bos)
    assert a == b
    assert [r.index for r in a] == list(range(5))
    assert all(10 <= r.prompt_tokens_target <= 20 and r.max_tokens == 8 for r in a)
    closed = plan(WorkloadSpec("c", "closed", 3, (4, 4), 2, concurrency=2), words_plus_bos)
    assert [r.at_s for r in closed] == [0.0] * 3


def test_spec_refuses_nonsense():
    with pytest.raises(ValueError):
        WorkloadSpec("w", "poisson", 5, (10, 20), 8, rate=0.0)
    with pytest.raises(ValueError):
        WorkloadSpec("w", "burst", 5, (10, 20), 8)
    with pytest.raises(ValueError):
        WorkloadSpec("w", "closed", 5, (20, 10), 8)


def test_every_arm_runs_once_per_repetition_the_first_rotating():
    from bench.lib.arms import rotated

    assert [rotated(["a", "b", "c"], rep) for rep in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert rotated([], 3) == []
