"""Packaging pins: the project's operator/ folder never shadows the stdlib `operator`
module, and the `tandem` entry point stays light (no torch for --help)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def _python(code: str) -> subprocess.CompletedProcess[str]:
    """Runs code in the installed venv with cwd = repo root (so '' on sys.path is the repo)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_stdlib_operator_is_not_shadowed_and_tandem_operator_is_the_project_folder() -> None:
    proc = _python(
        """
        import sys, pathlib
        assert sys.path[0] == '', sys.path[:3]   # the repo root itself is importable from
        import operator
        assert operator.itemgetter(1)((10, 20)) == 20
        assert operator.add(2, 3) == 5
        assert not hasattr(operator, '__path__'), operator  # a module, not our folder
        import tandem.operator
        print(pathlib.Path(list(tandem.operator.__path__)[0]).resolve())
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == (REPO_ROOT / "operator").resolve()


def test_cli_parser_builds_without_importing_torch() -> None:
    proc = _python(
        """
        import sys
        from tandem.cli.main import build_parser
        build_parser().format_help()
        heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)
        assert not heavy, heavy
        """
    )
    assert proc.returncode == 0, proc.stderr


def test_tandem_console_script_help_lists_subcommands() -> None:
    script = Path(sys.executable).parent / "tandem"
    exe = str(script) if script.exists() else shutil.which("tandem")
    assert exe, f"the `tandem` console script is not installed next to {sys.executable}"
    proc = subprocess.run(
        [exe, "--help"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    for sub in ("up", "worker", "router", "operator"):
        assert sub in proc.stdout
