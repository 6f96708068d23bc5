"""A name retired because it meant two things (issue 32, "one meaning per name") stays retired: the
product source is read with `ast` for the old classes, functions and modules, and each failure says
what the name became. Add a rename here when you make one."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("bench", "cli", "contracts", "operator", "planning", "router", "testing", "worker")

# class name -> (what it became, the one file still allowed to define a class of that name, if any)
RETIRED_CLASSES: dict[str, tuple[str, str | None]] = {
    "Sequence": ("worker/engine/sequence.py: EngineSequence (Sequence is collections.abc's)", None),
    "Prefilled": ("worker/engine/async_engine.py: PrefillOutput (Prefilled is the router's outcome)",
                  "router/outcomes.py"),
    "Failed": ("router/outcomes.py: CallFailed (the outcome: a call to a worker failed)", None),
    "Fail": ("router/actions.py: EndWithError (the action: end the request with an error)", None),
    "Fault": ("router/actions.py: Blame (the effect: the worker a failure is counted against)", None),
    "GroupLeader": ("worker/engine/parallel/rank_zero.py: RankZero (a leader is the operator's elected "
                    "replica)", None),
    "Plan": ("router/policies/base.py: Route (the policy's choice of workers); router/runtimes/vllm_request.py: "
             "DecodeCall (a plan is capacity: tandem plan's recommendation)", "planning/recommend.py"),
}

# module-level function name -> (what it became, the one file still allowed to define it, if any)
RETIRED_FUNCTIONS: dict[str, tuple[str, str | None]] = {
    "decide": ("operator/autoscaling/autoscaler.py: autoscale (decide is the router's pure step)",
               "router/decide.py"),
    "kv_release": ("worker/server/kv_peer.py: release", None),
    "kv_check": ("worker/server/kv_peer.py: check", None),
    "kv_metadata": ("worker/server/kv_peer.py: metadata", None),
    "kv_health": ("worker/server/kv_peer.py: health", None),
    "generation_hash": ("operator/render/identity.py: kv_compat_hash (generation is metadata.generation)", None),
    "pick_generation": ("router/policies/base.py: pick_kv_compat (generation is metadata.generation)", None),
    "decode_plan": ("router/runtimes/vllm_request.py: decode_call", None),
    "pull_plan": ("contracts/kv_layout.py: pull_slices", None),
    "_plan": ("worker/engine/hf/tensor_parallel.py: _tp_styles", None),
}

# "plan" is capacity (tandem plan, the autoscaler's planner): in the router and the worker nothing is called
# plan. -> what each became
PLAN_IN = ("router", "worker")
PLAN_BECAME = ("the routing policy's route(); worker/local/up.py and worker/vllm/local.py processes(); "
               "worker/vllm/launch.py launch_for(); worker/kv/pull_transport.py slices()")

# module -> what it became
RETIRED_MODULES: dict[str, str] = {
    "tandem.router.steps": "tandem.router.outcomes (what happened) and tandem.router.actions (what next)",
    "tandem.worker.kv.pulling": "tandem.worker.kv.pull_transport (the engine's PULLING stage is "
                                "tandem.worker.engine.kv_pull)",
    "tandem.router.parity_checker": "tandem.router.parity.checker",
    "tandem.router.parity_probe": "tandem.router.parity.probe",
    "tandem.worker.engine.parallel.leader": "tandem.worker.engine.parallel.rank_zero (tandem.operator.leader "
                                            "is the Lease election)",
    "tandem.operator.lease": "tandem.operator.election (a lease in the worker is a KV lease)",
}

# "generation" is Kubernetes' metadata.generation (and text generation); what a prefill and a decode worker
# must share to hand KV to each other is their kv-compat. string constant -> what it became
RETIRED_STRINGS: dict[str, str] = {
    "tandem.dev/generation": "tandem.dev/kv-compat (contracts/names.py LABEL_KV_COMPAT)",
    "TANDEM_GENERATION": "TANDEM_KV_COMPAT",
    "--generation": "--kv-compat (tandem worker)",
    "kv_generation_mismatch": "kv_compat_mismatch",
    "no_matching_generation": "no_matching_kv_compat (RouteReason.NO_MATCHING_KV_COMPAT)",
}
# a module-level name or a class field -> what it became; the fields are checked outside operator/, whose
# `generation` fields are metadata.generation
RETIRED_NAMES: dict[str, str] = {
    "LABEL_GENERATION": "contracts/names.py: LABEL_KV_COMPAT",
    "NO_MATCHING_GENERATION": "contracts/routing.py: RouteReason.NO_MATCHING_KV_COMPAT",
}
RETIRED_FIELDS: dict[str, str] = {
    "generation": "kv_compat (WorkerInfo, KVSource, WorkerView, Target, the worker's config: only equal "
                  "kv_compat values are paired)",
    "kv_generation": "kv_compat (the journey's: the kv_compat of the worker that computed its KV)",
}

# the worker's prefill module serves /internal/prefill only: abort is abort.py, /internal/kv/* kv_peer.py
PREFILL_ROUTES = ROOT / "worker/server/prefill.py"


@functools.cache
def product_files() -> tuple[Path, ...]:
    return tuple(sorted(p for top in PRODUCT for p in (ROOT / top).rglob("*.py")
                        if ".venv" not in p.parts and "results" not in p.parts))


@functools.cache
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _imported_modules(tree: ast.Module) -> set[str]:
    """Every module a file imports, `from a.b import c` counted as both a.b and a.b.c."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_retired_classes_and_functions_are_not_defined_again():
    found = []
    for path in product_files():
        rel = path.relative_to(ROOT).as_posix()
        tree = _parse(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name in RETIRED_CLASSES:
                became, allowed = RETIRED_CLASSES[node.name]
                if rel != allowed:
                    found.append(f"{rel}:{node.lineno}: class {node.name} is retired; it became {became}")
        for node in tree.body:  # module level: a method named like a retired function is another thing
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in RETIRED_FUNCTIONS:
                became, allowed = RETIRED_FUNCTIONS[node.name]
                if rel != allowed:
                    found.append(f"{rel}:{node.lineno}: def {node.name} is retired; it became {became}")
    assert found == []


def test_nothing_in_the_router_or_the_worker_is_a_plan():
    found = []
    for path in product_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel.split("/")[0] not in PLAN_IN:
            continue
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name.lower() == "plan":
                found.append(f"{rel}:{node.lineno}: {node.name} is retired here; it became {PLAN_BECAME}")
            elif isinstance(node, ast.Attribute) and node.attr == "plan":
                found.append(f"{rel}:{node.lineno}: .plan is retired here; it became {PLAN_BECAME}")
    assert found == []


def test_retired_strings_names_and_fields_are_not_used_again():
    found = []
    for path in product_files():
        rel = path.relative_to(ROOT).as_posix()
        tree = _parse(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found += [f"{rel}:{node.lineno}: {old!r} is retired; it became {new}"
                          for old, new in RETIRED_STRINGS.items() if old in node.value]
            elif isinstance(node, ast.ClassDef) and not rel.startswith("operator/"):
                found += [f"{rel}:{item.lineno}: field {item.target.id} of {node.name} is retired; it became "
                          f"{RETIRED_FIELDS[item.target.id]}" for item in node.body
                          if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                          and item.target.id in RETIRED_FIELDS]
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            found += [f"{rel}:{node.lineno}: {t.id} is retired; it became {RETIRED_NAMES[t.id]}"
                      for t in targets if isinstance(t, ast.Name) and t.id in RETIRED_NAMES]
    assert found == []


def test_the_kv_compat_label_is_the_documented_one():
    from tandem.contracts.names import LABEL_KV_COMPAT
    assert LABEL_KV_COMPAT == "tandem.dev/kv-compat"
    docs = [p for p in (ROOT / "docs").rglob("*.md")] + sorted(ROOT.glob("*/README.md")) + sorted(
        ROOT.glob("*/*/README.md"))
    stale = [p.relative_to(ROOT).as_posix() for p in docs if "tandem.dev/generation" in p.read_text()
             or "TANDEM_GENERATION" in p.read_text()]
    assert stale == [], "the docs name tandem.dev/kv-compat and TANDEM_KV_COMPAT"


@pytest.mark.parametrize("module", sorted(RETIRED_MODULES))
def test_a_retired_module_is_neither_there_nor_imported(module: str):
    parts = module.split(".")[1:]
    assert not (ROOT.joinpath(*parts[:-1]) / f"{parts[-1]}.py").exists(), \
        f"{module} is retired; it became {RETIRED_MODULES[module]}"
    importers = [path.relative_to(ROOT).as_posix() for path in product_files() + tuple(sorted((ROOT / "tests").rglob("*.py")))
                 if any(m == module or m.startswith(module + ".") for m in _imported_modules(_parse(path)))]
    assert importers == [], f"{module} is retired; it became {RETIRED_MODULES[module]}"


def test_the_prefill_module_serves_prefill_only():
    functions = {node.name for node in _parse(PREFILL_ROUTES).body
                 if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}
    assert functions == {"prefill"}, \
        "abort lives in worker/server/abort.py and every /internal/kv/* route in kv_peer.py (or kv_events.py)"


def test_the_checks_see_what_they_check():
    """The scan reads the modules the renames went to, so an empty finding means something."""
    files = {p.relative_to(ROOT).as_posix() for p in product_files()}
    assert {"router/outcomes.py", "router/actions.py", "router/parity/checker.py", "worker/kv/pull_transport.py",
            "worker/server/kv_peer.py", "worker/server/abort.py", "worker/engine/sequence.py"} <= files
