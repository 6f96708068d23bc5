"""One lazy registry for every family with several implementations (KV backends, routing policies,
the router's worker clients and the operator's role renderers per runtime): a name maps to
"module:attribute", and the module is imported only when that name is chosen (the shape of vLLM's
kv_connector factory), so a heavy or optional dependency stays out of every process that does not
choose it. Standard library only: the router and the operator import it."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any


def check_name(table: Mapping[str, str], name: str, what: str) -> None:
    """ValueError naming the known ones when `name` is not registered in `table`."""
    if name not in table:
        raise ValueError(f"unknown {what} {name!r}; known: {sorted(map(str, table))}")


def resolve(table: Mapping[str, str], name: str, what: str) -> Any:
    """The attribute registered under `name`, its module imported now (ImportError passes through)."""
    check_name(table, name, what)
    module_name, attribute = table[name].split(":")
    return getattr(importlib.import_module(module_name), attribute)
