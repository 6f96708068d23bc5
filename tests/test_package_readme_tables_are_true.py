"""Package READMEs' file tables cannot drift: every file or folder a table names (in backquotes)
exists, and every module of a package is named in its README's table. A name resolves against the
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


def unnamed_modules(readme: Path) -> list[str]:
    """The modules under `readme`'s folder its tables never name: not by their path, their file
    name, a longer path ending in it, or a folder holding them (a folder with its own README, as
    worker/engine/parallel/, is that README's to name)."""
    named = {name for row in table_rows(readme) for name in TOKEN.findall(row)}
    folders = [n for n in named if n.endswith("/")]
    out = []
    for path in sorted(readme.parent.rglob("*.py")):
        module = path.relative_to(readme.parent).as_posix()
        if path.name == "__init__.py" or any(module.startswith(f) for f in folders):
            continue
        if module in named or path.name in named or any(n.endswith("/" + module) for n in named):
            continue
        out.append(module)
    return out


@pytest.mark.parametrize("readme", package_readmes(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_a_readme_table_names_every_module_of_its_package(readme: Path):
    assert unnamed_modules(readme) == []


def test_an_unnamed_module_is_caught(tmp_path):
    (tmp_path / "named.py").write_text("")
    (tmp_path / "forgotten.py").write_text("")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "inner.py").write_text("")
    (tmp_path / "README.md").write_text("| file | what |\n|---|---|\n| `named.py` | one |\n| `sub/` | a folder |\n")
    assert unnamed_modules(tmp_path / "README.md") == ["forgotten.py"]


def test_a_wrong_name_is_caught(tmp_path):
    readme = tmp_path / "README.md"
    (tmp_path / "real.py").write_text("")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "inner.py").write_text("")
    readme.write_text("| file | what |\n|---|---|\n| `real.py` | ok |\n| `sub/inner.py`, `gone.py` | one gone |\n"
                      "| `sub/` | `inner.py` resolves in the row's folder; `renamed.py` does not |\n")
    assert missing_names(readme) == ["gone.py", "renamed.py"]
