"""Chooses a role renderer by runtime name and imports it only then (the shape of vLLM's
kv_connector factory and of the router's runtimes/registry.py): a name maps to "module:Class".
`render()` takes the runtime's name (default `tandem`; issue 29 reads it from `spec.runtime`)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from tandem.contracts.runtimes import Runtime

if TYPE_CHECKING:
    from tandem.operator.render.runtimes.base import RoleRenderer

# Every name in tandem.contracts.runtimes.Runtime.
RENDERERS: dict[str, str] = {
    Runtime.TANDEM: "tandem.operator.render.runtimes.tandem:TandemRoleRenderer",
}


def check_runtime(name: str) -> None:
    """Raise ValueError naming the known runtimes when `name` is not one of them."""
    if name not in RENDERERS:
        raise ValueError(f"unknown runtime {name!r}; known: {sorted(map(str, RENDERERS))}")


def role_renderer(name: str) -> RoleRenderer:
    check_runtime(name)
    module_name, cls_name = RENDERERS[name].split(":")
    return getattr(importlib.import_module(module_name), cls_name)()
