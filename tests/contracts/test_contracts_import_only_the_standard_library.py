"""The contracts package is shared by the operator, the router and the workers: importing any of it
loads nothing outside the standard library (no torch, no aiohttp, no kubernetes)."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import tandem.contracts


def test_every_contract_module_imports_only_the_standard_library():
    modules = [f"tandem.contracts.{m.name}" for m in pkgutil.iter_modules(tandem.contracts.__path__)]
    assert {"tandem.contracts.protocol", "tandem.contracts.names", "tandem.contracts.prefix"} <= set(modules)
    code = (
        "import sys, json, importlib\n"
        "before = set(sys.modules)\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "new = {n.split('.')[0] for n in set(sys.modules) - before}\n"
        "print(json.dumps(sorted(new - set(sys.stdlib_module_names) - {'tandem'})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
