"""Percentiles, ITL pooling and TPOT as `vllm bench serve` defines them."""

import math

import pytest

from bench.lib.metrics import (
    RequestRecord,
    distribution,
    percentile,
    pooled_itl,
    run_duration,
    spread,
    summarize,
    text_mismatches,
)


def rec(index: int, send: float, chunks: list[float], tokens: int | None = None, **kw) -> RequestRecord:
    r = RequestRecord(index, 100, len(chunks), send_s=send, chunk_times_s=chunks,
                      end_s=chunks[-1] if chunks else send, **kw)
    r.completion_tokens = tokens if tokens is not None else len(chunks)
    return r


def test_percentile_interpolates_like_numpy():
    v = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(v, 50) == 3.0
    assert percentile(v, 90) == pytest.approx(4.6)
    assert percentile(v, 0) == 1.0 and percentile(v, 100) == 5.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(v, 101)


def test_distribution_reports_tail_and_count():
    d = distribution([0.1] * 98 + [1.0, 2.0])
    assert d["p50"] == pytest.approx(0.1)
    assert d["max"] == 2.0
    assert d["n"] == 100
    assert 0.1 < d["p99"] < 2.0


def test_itl_pools_every_gap_of_every_request():
    a = rec(0, 0.0, [1.0, 1.1, 1.3])
    b = rec(1, 0.5, [2.0, 3.0])
    assert pooled_itl([a, b]) == pytest.approx([0.1, 0.2, 1.0])


def test_failed_requests_contribute_no_latency():
    bad = rec(2, 0.0, [1.0, 5.0], error="HTTP 500")
    assert bad.ttft is None and bad.gaps == [] and bad.tpot is None
    s = summarize([rec(0, 0.0, [0.5, 0.6]), bad])
    assert s["errors"] == 1 and s["completed"] == 1
    assert s["ttft"]["n"] == 1 and s["itl"]["n"] == 1


def test_tpot_uses_reported_token_count():
    # 11 tokens over 2 s after the first one: 0.2 s per output token, even if chunks merged.
    r = rec(0, 0.0, [1.0, 2.0, 3.0], tokens=11)
    assert r.ttft == 1.0
    assert r.tpot == pytest.approx(0.2)
    assert rec(1, 0.0, [1.0], tokens=1).tpot is None


def test_run_duration_spans_first_send_to_last_end():
    assert run_duration([rec(0, 1.0, [2.0, 3.0]), rec(1, 2.0, [4.0, 6.0])]) == pytest.approx(5.0)


def test_spread_is_median_and_range_ignoring_nan():
    s = spread([2.0, math.nan, 1.0, 4.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.0, 1.0, 4.0, 3)
    assert spread([math.nan])["n"] == 0


def test_text_mismatches_compares_against_the_reference():
    a = rec(0, 0.0, [1.0], text="hello")
    b = rec(1, 0.0, [1.0], text="world")
    assert text_mismatches([a, b], {0: "hello", 1: "word"}) == [1]
    reference = {0: "hello"}
    assert text_mismatches([a, b], reference) == [] and reference == {0: "hello", 1: "world"}
