"""Chooses a role renderer by runtime name and imports it only then (the shape of vLLM's
kv_connector factory and of the router's runtimes/registry.py): a name maps to "module:Class".
`render()` takes the runtime's name from `spec.runtime.name` (default `tandem`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.contracts.lazy_registry import check_name, resolve
from tandem.contracts.runtimes import Runtime

if TYPE_CHECKING:
    from tandem.operator.render.runtimes.base import RoleRenderer

# Every name in tandem.contracts.runtimes.Runtime.
RENDERERS: dict[str, str] = {
    Runtime.TANDEM: "tandem.operator.render.runtimes.tandem:TandemRoleRenderer",
    Runtime.VLLM: "tandem.operator.render.runtimes.vllm:VllmRoleRenderer",
}


def check_runtime(name: str) -> None:
    """Raise ValueError naming the known runtimes when `name` is not one of them."""
    check_name(RENDERERS, name, "runtime")


def role_renderer(name: str) -> RoleRenderer:
    return resolve(RENDERERS, name, "runtime")()
