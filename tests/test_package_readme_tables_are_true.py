"""Package READMEs' file tables cannot drift: every file or folder a table names (in backquotes)
exists, and the router's table names every module of the router. A name resolves against the
README's folder, the repository root, or a folder the same row named before it (so
"`worker/engine/sampling.py`, `detokenizer.py`" and "`render/` ... `worker.py`" read as written)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("router", "worker/*", "operator", "bench", "contracts", "planning")
TOKEN = re.compile(r"`([^`\s]+)`")
PATH_LIKE = re.compile(r"^[\w.\-/]+(\.(py|md|ya?ml|json|toml|sh|txt)|/)$")


def package_readmes() -> list[Path]:
    found: list[Path] = []
    for pattern in PACKAGES:
        found += sorted(p for p in ROOT.glob(f"{pattern}/**/README.md") if ".venv" not in p.parts)
    return found


def table_rows(readme: Path) -> list[str]:
    return [line for line in readme.read_text().splitlines()
            if line.startswith("|") and not set(line) <= set("|-: ")]


def missing_names(readme: Path) -> list[str]:
    """The file and folder names in `readme`'s tables that exist nowhere they could mean."""
    missing = []
    for row in table_rows(readme):
        bases = [readme.parent, ROOT]
        for name in TOKEN.findall(row):
            if not PATH_LIKE.match(name):
                continue
            hit = next((base / name for base in bases if (base / name).exists()), None)
            if hit is None:
                missing.append(name)
            elif (folder := hit if hit.is_dir() else hit.parent) not in bases:
                bases.append(folder)
    return missing


def test_every_package_with_a_readme_is_checked():
    names = {p.relative_to(ROOT).as_posix() for p in package_readmes()}
    assert {"router/README.md", "operator/README.md", "worker/engine/README.md"} <= names


@pytest.mark.parametrize("readme", package_readmes(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_a_readme_table_names_only_files_that_exist(readme: Path):
    assert missing_names(readme) == []


def test_the_router_table_names_every_router_module():
    readme = ROOT / "router" / "README.md"
    named = {name for row in table_rows(readme) for name in TOKEN.findall(row)}
    modules = [p.relative_to(readme.parent).as_posix() for p in sorted(readme.parent.rglob("*.py"))
               if p.name != "__init__.py"]
    assert [m for m in modules if m not in named and Path(m).name not in named] == []


def test_a_wrong_name_is_caught(tmp_path):
    readme = tmp_path / "README.md"
    (tmp_path / "real.py").write_text("")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "inner.py").write_text("")
    readme.write_text("| file | what |\n|---|---|\n| `real.py` | ok |\n| `sub/inner.py`, `gone.py` | one gone |\n"
                      "| `sub/` | `inner.py` resolves in the row's folder; `renamed.py` does not |\n")
    assert missing_names(readme) == ["gone.py", "renamed.py"]
