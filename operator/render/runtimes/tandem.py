"""The `tandem` runtime's roles: `tandem worker --role <role> --config ...` in the worker image, its
settings in the ConfigMap (config_files.worker_config), probes on its /ready and /health, and the
same pod for a group's leader and followers (they find their ranks from the LWS_* variables). Pure."""

from __future__ import annotations

from typing import Any

from tandem.contracts.names import GroupMember
from tandem.operator.config import OperatorConfig
from tandem.operator.render.config_files import worker_config
from tandem.operator.render.worker import worker_container
from tandem.operator.spec import InferenceServiceSpec, Parallelism


class TandemRoleRenderer:
    def config_file(self, name: str, role: str, spec: InferenceServiceSpec) -> dict[str, Any]:
        return worker_config(name, role, spec)

    def container(self, name: str, spec: InferenceServiceSpec, role: str, config: OperatorConfig,
                  kv_compat: str, model_mounts: list[dict]) -> dict[str, Any]:
        return worker_container(name, spec, role, config, kv_compat, model_mounts)

    def group_member(self, pod: dict[str, Any], member: GroupMember, parallelism: Parallelism
                     ) -> dict[str, Any]:
        return pod
