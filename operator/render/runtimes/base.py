"""The role renderer: what differs between runtimes in running a prefill or decode role. Pure.

Everything else about a worker pod is every runtime's and rendered once: the weights' volumes and
init containers (weights.py), resources, the security context, placement and spread (worker.py),
the Deployment or the LeaderWorkerSet and its group placement (worker.py, group.py), the headless
Service, the PodDisruptionBudget, the internal Secret and the NetworkPolicy (objects.py, trust.py),
and the kv_compat label that pairs prefill with decode (identity.py). docs/request-lifecycle.md
says what the `tandem` renderer gives at each point and what a vLLM one (issue 29) will.
"""

from __future__ import annotations

from typing import Any, Protocol

from tandem.contracts.names import GroupMember
from tandem.operator.config import OperatorConfig
from tandem.operator.spec import InferenceServiceSpec, Parallelism


class RoleRenderer(Protocol):
    """One runtime's way of running a worker role (registry.py picks it by name)."""

    def config_file(self, name: str, role: str, spec: InferenceServiceSpec) -> dict[str, Any]:
        """The role's file in the ConfigMap (`<role>.yaml`, mounted at /etc/tandem/config.yaml): its
        hash is on the role's pod template, so a change to it rolls that role only."""
        ...

    def container(self, name: str, spec: InferenceServiceSpec, role: str, config: OperatorConfig,
                  kv_compat: str, model_mounts: list[dict]) -> dict[str, Any]:
        """The worker container: image, command and args, ports (one named `http`: the router,
        discovery, the probes and the operator's scrapes reach it there), env (the kv_compat, the
        internal secret, UCX), resources, the config, /dev/shm and weights mounts, security, and
        the probes on the runtime's own health endpoints."""
        ...

    def group_member(self, pod: dict[str, Any], member: GroupMember, parallelism: Parallelism
                     ) -> dict[str, Any]:
        """The pod a leader or a follower of a group spanning nodes runs (LeaderWorkerSet), from the
        group's pod: what the two run differently (a runtime whose followers start another way)."""
        ...
