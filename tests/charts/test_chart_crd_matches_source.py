"""The chart's CRD is byte for byte the one in crds/: Helm only installs CRDs from the chart's own
crds/ folder. Both are written by `python -m tandem.operator.crd` from the typed spec
(tests/operator/test_crd_is_generated_from_the_typed_spec.py)."""

from __future__ import annotations

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
