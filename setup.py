"""Maps the source folders into the `tandem` namespace.

`operator` is also a standard-library module, so operator/ must never be
importable on its own: its top has no __init__.py and it is installed only as
`tandem.operator`. `tandem` itself is a namespace package.
"""

from pathlib import Path

from setuptools import setup

ROOTS = {
    "tandem.cli": "cli",
    "tandem.contracts": "contracts",  # what crosses a process boundary; imports nothing heavy
    "tandem.operator": "operator",
    "tandem.worker": "worker",
    "tandem.router": "router",  # the OpenAI endpoint; never imports torch
    "tandem.planning": "planning",  # sizing a deployment from measurements (`tandem plan`); no torch at import
    "tandem.weights": "weights",  # hub revisions, config.json, downloads; no torch
    "tandem.testing": "testing",  # control-plane harness and toy model, shared by tests and bench
}


def _packages() -> tuple[list[str], dict[str, str]]:
    """Every folder under the roots that holds Python files becomes a package."""
    here = Path(__file__).parent
    packages, package_dir = [], {}
    for name, folder in ROOTS.items():
        root = here / folder
        for d in sorted([root, *root.rglob("*")]):
            if not d.is_dir() or "__pycache__" in d.parts or not any(d.glob("*.py")):
                continue
            rel = d.relative_to(root).parts
            pkg = ".".join([name, *rel])
            packages.append(pkg)
            package_dir[pkg] = str(Path(folder, *rel))
    return packages, package_dir


PACKAGES, PACKAGE_DIR = _packages()
setup(packages=PACKAGES, package_dir=PACKAGE_DIR)
