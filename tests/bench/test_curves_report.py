"""The curves scenario's tables and figure (issue 23 point 5): every arm's point at every length and
concurrency, what the reduced grid left out, the load it ran under, and the handoff against its bound."""

from bench.lib.curves_report import SECTION, plot, results_markdown
from bench.scenarios.curves import GRIDS


def _arm(description, ttft, conc, pulls=None):
    pulls = pulls or {}
    return {"description": description, "ready_s": 42.0,
            "loadavg": {"samples": 3, "min": 1.0, "median": 2.0, "max": 5.5},
            "ttft": {str(n): {"ttft_p50": t, "errors": 0, "pull_s_p50": pulls.get(n, (None, None))[0],
                              "pull_bytes": pulls.get(n, (None, None))[1],
                              "routes": {"disaggregated": 1, "prefill_saturated": 1} if n == 128 and pulls else {}}
                     for n, t in ttft.items()},
            "concurrency": {str(c): {"itl_p50": a, "itl_p99": b, "output_tokens_per_s": t, "errors": e}
                            for c, (a, b, t, e) in conc.items()}}


def _result():
    return {"grid": "reduced", "ttft_reps": 2, "output_len": 32, "prompt_lens": [128, 8192], "concurrency": [1, 128],
            "left_out": {"prompt_lens": [256, 1024], "concurrency": [2, 8]},
            "skipped_arms": {"vllm-bf16": "not installed"},
            "arms": {"disagg-bf16": _arm("disaggregated 1P+1D, NIXL, bf16", {128: 0.05, 8192: 9.5},
                                         {1: (0.012, 0.02, 70.0, 0), 128: (0.2, 1.5, 400.0, 3)},
                                         {128: (0.002, 2**20), 8192: (0.1, 64 * 2**20)}),
                     "colo2-c128-bf16": _arm("colocated, 2 workers", {128: 0.04, 8192: 12.0},
                                             {1: (0.011, 0.03, 75.0, 0), 128: (0.15, 2.5, 450.0, 0)})},
            "handoff": {"8192": {"bytes": 128 * 2**20, "nixl_s": 0.2, "tcp_s": 0.4, "raw_tcp_s": 0.1,
                                 "memcpy_s": 0.01}},
            "handoff_run": "20260101-000000", "handoff_loadavg": {"samples": 2, "min": 0.5, "median": 0.7, "max": 0.9}}


def test_the_reduced_grid_is_part_of_the_full_one_and_reaches_both_ends():
    full_lens, full_levels, _ = GRIDS["full"]
    lens, levels, _ = GRIDS["reduced"]
    assert set(lens) < set(full_lens) and set(levels) < set(full_levels)
    assert (min(full_lens), min(full_levels), max(full_levels)) == (128, 1, 128) and 8000 <= max(full_lens) <= 8190
    assert (min(lens), max(lens), min(levels), max(levels)) == (128, max(full_lens), 1, 128)


def test_the_tables_hold_every_arm_at_every_point_with_its_load():
    md = results_markdown(_result(), "20260102-000000", "python -m bench curves --grid reduced", "bench/figures/c.svg")
    assert "grid reduced (left out of the full grid: prompts 256, 1024; concurrency 2, 8)" in md
    assert "| 8192 | 9.50 s | 12.00 s |" in md and "| 128 | 50 ms (1 of 2 routed prefill_saturated) | 40 ms |" in md
    assert "| 128 | 200 ms / 1.50 s (3 errors) | 150 ms / 2.50 s | 400 | 450 |" in md
    assert md.count("load average 1.0-5.5 (median 2.0) while measured") == 2
    assert "**vllm-bf16**: skipped (not installed)" in md
    assert "| 8192 | 64.0 | 100 ms | 0.67 |" in md  # the arm's own pull: bytes, time, GB/s
    assert "| 8192 | 128.0 | 200 ms | 400 ms | 100 ms | 10 ms | 0.50 | 0.25 |" in md
    assert "load average 0.5-0.9" in md and "![curves](bench/figures/c.svg)" in md


def test_publishing_replaces_only_the_marked_section(tmp_path):
    doc = tmp_path / "BENCHMARKS.md"
    (begin, end), heading = SECTION.markers, SECTION.heading
    doc.write_text(f"# B\n\nbefore\n\n{heading}\n\n{begin}\nold table\n{end}\n\nafter, by hand\n")
    SECTION.write(results_markdown(_result(), "20260102-000000", "python -m bench curves"), doc)
    text = doc.read_text()
    assert "old table" not in text and "before" in text and "after, by hand" in text and text.count(heading) == 1
    assert "| 8192 | 9.50 s | 12.00 s |" in text


def test_the_figure_is_a_small_svg(tmp_path):
    path = plot(_result(), tmp_path / "curves.svg")
    text = path.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text and len(text) < 400_000
