"""The one shape of a report: figures formatted for BENCHMARKS.md (pure, unit-tested), a generated
Section put between its markers while keeping the prose around it, and a result's full form (every
request's record, under the run's out folder) apart from its committed summary (without them)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.lib.metrics import get_path, spread
from bench.lib.results import ROOT, json_safe


def fmt_s(x: float | None) -> str:
    """Seconds for a table: ms below one second."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x * 1000:.0f} ms" if abs(x) < 1 else f"{x:.2f} s"


def fmt_num(x: float | None, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{digits}f}"


def fmt_pct(x: float | None) -> str:
    return "–" if x is None or math.isnan(x) else f"{100 * x:.0f}%"


def fmt_ratio(s: dict[str, float] | None) -> str:
    """'median [min–max]' over repetitions; just the value when there is one."""
    if not s or s.get("n", 0) == 0 or s.get("median") is None or math.isnan(s["median"]):
        return "–"
    if s["n"] == 1 or s["min"] == s["max"]:
        return f"{s['median']:.2f}"
    return f"{s['median']:.2f} [{s['min']:.2f}–{s['max']:.2f}]"


def fmt_s_range(s: dict[str, float]) -> str:
    """'41 ms [38–45]': median and range over repetitions, in the median's unit."""
    if s["n"] == 0:
        return "–"
    if s["n"] == 1 or s["min"] == s["max"]:
        return fmt_s(s["median"])
    if abs(s["median"]) < 1:
        return f"{s['median'] * 1e3:.0f} ms [{s['min'] * 1e3:.0f}–{s['max'] * 1e3:.0f}]"
    return f"{s['median']:.2f} s [{s['min']:.2f}–{s['max']:.2f}]"


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def median_range(runs: list[dict], arm: str, path: str) -> dict[str, float]:
    """The arm's median and range of one summary metric over its repetitions."""
    return spread([get_path(r["summary"], path) for r in runs if r["arm"] == arm])


def replace_section(doc: str, section: str, begin: str, end: str, heading: str) -> str:
    """Put the generated section between the markers (appended under `heading` when the document
    has none yet), keeping everything else as written."""
    block = f"{begin}\n{section}\n{end}"
    if begin in doc and end in doc:
        return re.sub(re.escape(begin) + r".*?" + re.escape(end), lambda _: block, doc, flags=re.S)
    return doc.rstrip() + f"\n\n{heading}\n\n" + block + "\n"


@dataclass(frozen=True)
class Section:
    """A generated section of BENCHMARKS.md: its markers, the command that writes it, and the heading
    it is appended under when the document has none yet."""

    name: str
    writer: str
    heading: str

    @property
    def markers(self) -> tuple[str, str]:
        """The BEGIN/END comments around it."""
        return (f"<!-- bench:{self.name}:begin (written by `{self.writer}`; edit outside these markers) -->",
                f"<!-- bench:{self.name}:end -->")

    def write(self, text: str, markdown: Path = ROOT / "BENCHMARKS.md") -> Path:
        doc = markdown.read_text() if markdown.exists() else "# Benchmarks\n"
        markdown.write_text(replace_section(doc, text, *self.markers, self.heading))
        return markdown


def write_full(result: dict[str, Any], out_dir: Path) -> Path:
    """The whole result, every request's record included, as out_dir/full.json (not committed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (full := out_dir / "full.json").write_text(json.dumps(json_safe(result), indent=1))
    return full


def without_records(result: dict[str, Any]) -> dict[str, Any]:
    """The committed summary: the result with its runs' per-request records left out."""
    return json_safe(result | {"runs": [{k: v for k, v in r.items() if k != "records"} for r in result["runs"]]})
