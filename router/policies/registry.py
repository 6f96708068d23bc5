"""Chooses the routing policy by name and imports it only then (same shape as the KV backends'
registry, tandem.worker.kv.registry): a name maps to "module:Class". `RouterConfig.policy`, set from
the InferenceService's `router.policy`, is checked against these names when the config loads."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.contracts.lazy_registry import check_name, resolve
from tandem.contracts.routing import RoutingPolicy

if TYPE_CHECKING:
    from tandem.router.policies.base import PolicySettings, RoutingPolicy

# Every name in tandem.contracts.routing.RoutingPolicy (what the CRD's router.policy allows).
POLICIES: dict[str, str] = {
    RoutingPolicy.LEAST_LOADED: "tandem.router.policies.least_loaded:LeastLoaded",
    RoutingPolicy.ROUND_ROBIN: "tandem.router.policies.round_robin:RoundRobin",
    RoutingPolicy.PREFIX_AWARE: "tandem.router.policies.prefix_aware:PrefixAware",
}


def check_policy(name: str) -> None:
    """Raise ValueError naming the known policies when `name` is not one of them."""
    check_name(POLICIES, name, "routing policy")


def policy_class(name: str) -> type[RoutingPolicy]:
    return resolve(POLICIES, name, "routing policy")


def create_policy(name: str, settings: PolicySettings | None = None) -> RoutingPolicy:
    return policy_class(name)(settings)
