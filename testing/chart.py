"""Helpers for tests of the Helm chart (charts/tandem): run helm, render, pick objects."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
CHART_DIR = REPO_ROOT / "charts" / "tandem"


def run_helm(
    helm: Path, *args: str, check: bool = True, env: dict[str, str] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """Runs helm; on failure (check=True) raises AssertionError with its stdout and stderr."""
    proc = subprocess.run(
        [str(helm), *args], capture_output=True, text=True, check=False, cwd=REPO_ROOT,
        timeout=timeout, env=env,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"helm {' '.join(args)} exited {proc.returncode}\n"
            f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        )
    return proc


def set_json_args(values: dict[str, Any]) -> list[str]:
    """`--set-json key=<value as JSON>` for every entry."""
    import json

    out: list[str] = []
    for key, value in values.items():
        out += ["--set-json", f"{key}={json.dumps(value)}"]
    return out


def render(
    helm: Path, release: str = "rel", namespace: str = "tandem-system", **values: Any
) -> list[dict[str, Any]]:
    """The objects `helm template` renders (hooks included, CRDs not); values by dotted key."""
    proc = run_helm(
        helm, "template", release, str(CHART_DIR), "--namespace", namespace, *set_json_args(values),
    )
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def find(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    """The objects of one kind (and name)."""
    return [
        o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]


def only(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """The one object of a kind; fails if there are none or several."""
    found = find(objs, kind)
    assert len(found) == 1, f"expected one {kind}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def operator_deployment(objs: list[dict[str, Any]]) -> dict[str, Any]:
    """The operator Deployment (the chart renders exactly one Deployment)."""
    return only(objs, "Deployment")


def operator_container(objs: list[dict[str, Any]]) -> dict[str, Any]:
    containers = operator_deployment(objs)["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]
