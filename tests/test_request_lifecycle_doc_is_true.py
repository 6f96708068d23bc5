"""docs/request-lifecycle.md cannot drift from the code it walks through: every file it names (in
backquotes) exists, every "`file.py`: `function`" it points to is defined in that file, and the
methods its runtime tables list are the seams' own (`WorkerClient`, `RoleRenderer`)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "request-lifecycle.md"
TOKEN = re.compile(r"`([^`\s]+)`")
PATH_LIKE = re.compile(r"^[\w.\-/]+(\.(py|md|ya?ml|json|toml|sh|txt)|/)$")
POINTER = re.compile(r"`([\w/]+\.py)`: `([\w.]+)`")  # "`router/app.py`: `Router._generate`"
SEAM_ROW = re.compile(r"^\| `(\w+)\(")  # a runtime table's first column: "| `info(url, role)` |"
SEAMS = {"### The router": ("router/worker_client.py", "WorkerClient"),
         "### The operator": ("operator/render/runtimes/base.py", "RoleRenderer")}
PACKAGES = ("router", "worker", "operator", "contracts", "testing", "tests")


def _files() -> list[str]:
    return [p.relative_to(ROOT).as_posix() for pkg in PACKAGES for p in (ROOT / pkg).rglob("*")]


def missing_files(text: str) -> list[str]:
    """Names that are no path from the root and end no file's path (a section names `prefill.py`
    after `worker/server/`)."""
    files = _files()
    return [name for name in TOKEN.findall(text) if PATH_LIKE.match(name)
            and not (ROOT / name).exists() and not any(f.endswith("/" + name.rstrip("/")) for f in files)]


def defines(path: Path, dotted: str) -> bool:
    """`path` defines `dotted`: a top-level function or class, or `Class.method` inside that class."""
    scope: list[ast.stmt] = ast.parse(path.read_text()).body
    for part in dotted.split("."):
        node = next((n for n in scope if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                     and n.name == part), None)
        if node is None:
            return False
        scope = node.body
    return True


def wrong_pointers(text: str) -> list[str]:
    return [f"{file}: {name}" for file, name in POINTER.findall(text)
            if not (ROOT / file).is_file() or not defines(ROOT / file, name)]


def missing_seam_methods(text: str) -> list[str]:
    out, seam = [], None
    for line in text.splitlines():
        if line.startswith("#"):
            seam = next((v for k, v in SEAMS.items() if line.startswith(k)), None)
        elif seam and (m := SEAM_ROW.match(line)) and not defines(ROOT / seam[0], f"{seam[1]}.{m[1]}"):
            out.append(f"{seam[1]}.{m[1]}")
    return out


def test_every_file_the_page_names_exists():
    assert missing_files(DOC.read_text()) == []


def test_every_function_the_page_points_to_is_defined_there():
    text = DOC.read_text()
    assert len(POINTER.findall(text)) >= 8  # the hop table's
    assert wrong_pointers(text) == []


def test_the_runtime_tables_list_the_seams_own_methods():
    text = DOC.read_text()
    assert sum(bool(SEAM_ROW.match(line)) for line in text.splitlines()) == 10  # WorkerClient 7, RoleRenderer 3
    assert missing_seam_methods(text) == []


def test_a_stale_name_is_caught():
    assert missing_files("`router/no_such_module.py`") == ["router/no_such_module.py"]
    assert wrong_pointers("`router/app.py`: `Router.no_such_method`") == ["router/app.py: Router.no_such_method"]
    assert missing_seam_methods("### The router\n| `no_such(url)` | x |") == ["WorkerClient.no_such"]
