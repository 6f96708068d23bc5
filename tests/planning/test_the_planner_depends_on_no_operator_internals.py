"""The pure planner's dependency points one way (issue 32.1): the operator depends on planning, and
planning/ imports nothing of the operator but its typed API (tandem.operator.spec: the
`spec.autoscaling` the planner reads). Before, planning/ imported tandem.operator.autoscaling."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = ("tandem.operator.spec",)


def imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_planning_imports_no_operator_module_but_the_typed_spec() -> None:
    wrong = {f"{p.relative_to(ROOT)}: {name}" for p in (ROOT / "planning").rglob("*.py") for name in imported(p)
             if name.startswith("tandem.operator") and not name.startswith(ALLOWED)}
    assert not wrong, sorted(wrong)


def test_the_planner_lives_in_planning_only() -> None:
    for module in ("planner", "demands", "snapshot", "scrape"):
        assert (ROOT / "planning" / "autoscaling" / f"{module}.py").is_file()
        assert not (ROOT / "operator" / "autoscaling" / f"{module}.py").exists(), module
