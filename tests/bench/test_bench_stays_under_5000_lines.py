"""bench/ stays under 5,000 lines of Python (issue 32 item 3: it was 7.3k, more than the operator).
A concluded experiment is archived (bench/cli.py ARCHIVED: results and conclusion kept, code in
git), and shared pieces live once in bench/lib/, rather than this limit being raised."""

from __future__ import annotations

from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
LIMIT = 5_000


def test_bench_is_under_5000_lines_of_python():
    files = [p for p in BENCH.rglob("*.py") if "out" not in p.relative_to(BENCH).parts]
    counts = {str(p.relative_to(BENCH)): len(p.read_text().splitlines()) for p in files}
    total = sum(counts.values())
    largest = sorted(counts.items(), key=lambda kv: -kv[1])[:5]
    assert total < LIMIT, f"bench/ has {total} lines of Python (limit {LIMIT}); the largest: {largest}"
