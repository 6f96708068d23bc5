"""The chart's CRD is byte for byte the one in crds/: Helm only installs CRDs from the chart's own
crds/ folder. Both are written by `python -m tandem.operator.crd` from the typed spec
(tests/operator/test_crd_is_generated_from_the_typed_spec.py); hack/sync-crd.sh copies too."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tandem.testing.chart import CHART_DIR, REPO_ROOT

SOURCE = REPO_ROOT / "crds" / "inferenceservices.tandem.dev.yaml"
COPY = CHART_DIR / "crds" / "inferenceservices.tandem.dev.yaml"


def test_chart_crd_equals_the_source_crd() -> None:
    assert SOURCE.is_file(), f"{SOURCE} is missing"
    assert COPY.is_file(), f"{COPY} is missing: run `python -m tandem.operator.crd`"
    assert COPY.read_bytes() == SOURCE.read_bytes(), (
        f"{COPY.relative_to(REPO_ROOT)} differs from {SOURCE.relative_to(REPO_ROOT)}: "
        "run `python -m tandem.operator.crd`"
    )


def test_chart_carries_only_that_crd() -> None:
    assert sorted(p.name for p in (CHART_DIR / "crds").iterdir()) == [SOURCE.name]


def test_sync_script_check_mode_agrees() -> None:
    proc = subprocess.run(
        ["bash", str(REPO_ROOT / "hack" / "sync-crd.sh"), "--check"],
        capture_output=True, text=True, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "up to date" in proc.stdout


def test_sync_script_detects_and_repairs_a_stale_copy(tmp_path: Path) -> None:
    """On a scratch copy of the three paths the script touches, never on the repo itself."""
    (tmp_path / "hack").mkdir()
    shutil.copy2(REPO_ROOT / "hack" / "sync-crd.sh", tmp_path / "hack" / "sync-crd.sh")
    (tmp_path / "crds").mkdir()
    (tmp_path / "crds" / SOURCE.name).write_bytes(SOURCE.read_bytes() + b"# changed\n")
    stale = tmp_path / "charts" / "tandem" / "crds" / SOURCE.name
    stale.parent.mkdir(parents=True)
    stale.write_bytes(SOURCE.read_bytes())
    script = str(tmp_path / "hack" / "sync-crd.sh")

    check = subprocess.run(["bash", script, "--check"], capture_output=True, text=True)
    assert check.returncode == 1 and "run hack/sync-crd.sh" in check.stderr
    sync = subprocess.run(["bash", script], capture_output=True, text=True)
    assert sync.returncode == 0, sync.stderr
    assert stale.read_bytes() == (tmp_path / "crds" / SOURCE.name).read_bytes()
