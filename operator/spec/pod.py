"""Pod settings a platform needs, the same for the prefill and decode workers and for the router:
scheduling priority, the runtime class, pull secrets, the pods' ServiceAccount, and a
PodDisruptionBudget; and the Image type. Declared once here; each component's dataclass lists them
(one line each).
"""

from __future__ import annotations

from typing import Any, ClassVar

from tandem.operator.spec.fields import IntOrPercent, Rule, api_field
from tandem.operator.spec.model import DNS_SUBDOMAIN, api_type


@api_type
class LocalObjectReference:
    """An object in the InferenceService's namespace, by name."""

    name: str = api_field("name", max_length=253, pattern=DNS_SUBDOMAIN)


@api_type
class DisruptionBudget:
    """A PodDisruptionBudget for these pods: how many a voluntary disruption (a node drain, a cluster
    upgrade) may take at once. Without maxUnavailable or minAvailable, maxUnavailable is 1."""

    enabled: bool = api_field("enabled", default=True, description="Render the PodDisruptionBudget.")
    max_unavailable: IntOrPercent | None = api_field(
        "maxUnavailable", description="Pods a disruption may take at once: a number or a percentage (25%).")
    min_available: IntOrPercent | None = api_field(
        "minAvailable", description="Pods that must stay up (a number or a percentage); a drain waits for "
        "them (minAvailable equal to replicas blocks drains).")

    RULES: ClassVar[tuple[Rule, ...]] = (Rule(
        "!(has(self.maxUnavailable) && has(self.minAvailable))",
        "{role}.podDisruptionBudget: set maxUnavailable or minAvailable, not both"),)

    def budget(self) -> dict[str, Any]:
        """The PodDisruptionBudget's spec fields other than the selector."""
        if self.min_available is not None:
            return {"minAvailable": self.min_available}
        return {"maxUnavailable": 1 if self.max_unavailable is None else self.max_unavailable}


@api_type
class Image:
    """A Tandem image; what is unset comes from the operator's config."""

    repository: str | None = api_field(
        "repository", max_length=512,
        pattern="^[a-z0-9]+([._-][a-z0-9]+)*(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)*$")
    tag: str | None = api_field(
        "tag", max_length=128,
        pattern="^[A-Za-z0-9_][A-Za-z0-9_.-]*(@sha256:[a-f0-9]{64})?$|^@?sha256:[a-f0-9]{64}$")
    pull_policy: str | None = api_field("pullPolicy", enum=["Always", "IfNotPresent", "Never"])


def priority_class_name() -> Any:
    return api_field(
        "priorityClassName", max_length=253, pattern=DNS_SUBDOMAIN,
        description="PriorityClass of the {role} pods (it must exist): lets serving preempt batch work.")


def runtime_class_name() -> Any:
    return api_field(
        "runtimeClassName", max_length=253, pattern=DNS_SUBDOMAIN,
        description="RuntimeClass of the {role} pods (it must exist), e.g. nvidia where the NVIDIA "
        "container runtime is not the node's default.")


def image_pull_secrets() -> Any:
    return api_field(
        "imagePullSecrets", max_items=16,
        extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        description="Secrets in this namespace holding credentials for the {role} image's registry.")


def service_account_name(what: str) -> Any:
    return api_field("serviceAccountName", max_length=253, pattern=DNS_SUBDOMAIN, description=what)


def pod_disruption_budget() -> Any:
    return api_field(
        "podDisruptionBudget", default={},
        description="The {role} pods' PodDisruptionBudget (default: rendered, maxUnavailable 1).")
