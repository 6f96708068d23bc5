"""The CRD files are exactly what `python -m tandem.operator.crd` writes from the typed spec, and
prefill and decode get their schema from one role type."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml
from tandem.operator import crd as generator

ROOT = Path(__file__).resolve().parents[2]


def test_both_crd_files_are_what_the_generator_writes():
    text = generator.render_yaml()
    for path in generator.TARGETS:
        assert (ROOT / path).is_file(), f"{path} is missing: run `python -m tandem.operator.crd`"
        assert (ROOT / path).read_text() == text, (
            f"{path} is stale (edited by hand, or the spec declarations changed): "
            "run `python -m tandem.operator.crd`")


def test_check_mode_names_a_stale_file_and_writing_repairs_it(tmp_path):
    """On a scratch root, never on the repository itself."""
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tandem.operator.crd", "--root", str(tmp_path), *args],
                              capture_output=True, text=True, timeout=120)

    assert run().returncode == 0
    assert run("--check").returncode == 0
    chart_copy = tmp_path / generator.TARGETS[1]
    chart_copy.write_text(chart_copy.read_text().replace("default: 4096", "default: 2048"))
    check = run("--check")
    assert check.returncode == 1
    assert [line.split()[0] for line in check.stderr.splitlines()] == [str(generator.TARGETS[1])]
    assert "run `python -m tandem.operator.crd`" in check.stderr
    assert run().returncode == 0 and run("--check").returncode == 0
    assert chart_copy.read_text() == generator.render_yaml()


def _roles(doc: dict) -> tuple[dict, dict]:
    spec = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    return spec["prefill"], spec["decode"]


def test_prefill_and_decode_differ_only_where_the_role_is_named():
    prefill, decode = _roles(yaml.safe_load(generator.render_yaml()))
    # Same fields, types and bounds; what differs is the role's name in text, and the grace period.
    grace = "terminationGracePeriodSeconds"
    assert prefill["properties"][grace]["default"] == 120 and decode["properties"][grace]["default"] == 60
    for schema in (prefill, decode):
        del schema["properties"][grace], schema["description"]
    # A field named for prompt prefill itself (not for the role) keeps its name in both roles.
    swapped = yaml.safe_dump(prefill).replace("prefillChunkTokens", "\0").replace("prefill", "decode")
    swapped = swapped.replace("\0", "prefillChunkTokens")
    assert yaml.safe_load(swapped) == decode
    assert decode["properties"]["replicas"]["description"] == (
        "Number of decode workers (a worker is one pod, or a group of parallelism.nodes pods).")
    gpus_rule = decode["x-kubernetes-validations"][0]
    assert gpus_rule["messageExpression"].startswith("'decode.gpus is %d but"), "the numbers, per role"
    assert decode["properties"]["engine"]["x-kubernetes-validations"][0]["message"].startswith("decode.engine:")


def test_the_generated_yaml_is_the_generators_dict_and_has_no_anchors():
    text = generator.render_yaml()
    assert yaml.safe_load(text) == generator.crd()
    assert "&id" not in text and "*id" not in text
    assert text.startswith("# InferenceService") and "python -m tandem.operator.crd" in text.splitlines()[1]
