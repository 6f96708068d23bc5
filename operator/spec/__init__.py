"""The InferenceService API, typed: one declaration per field gives the parser and the CRD schema."""

from tandem.operator.spec.autoscaling import AutoscalingSpec, Mode, RoleScaling
from tandem.operator.spec.fields import SpecError, to_json
from tandem.operator.spec.inference_service import (
    COMPONENTS,
    RESERVED_ENV,
    ROUTER,
    WORKER_ROLES,
    Engine,
    EnvVar,
    Image,
    InferenceServiceSpec,
    KVTransfer,
    Model,
    NetworkPolicySpec,
    Router,
    Toleration,
    WorkerRole,
)
from tandem.operator.spec.parallelism import Parallelism

__all__ = [
    "AutoscalingSpec",
    "Mode",
    "RoleScaling",
    "COMPONENTS",
    "RESERVED_ENV",
    "ROUTER",
    "WORKER_ROLES",
    "Engine",
    "EnvVar",
    "Image",
    "InferenceServiceSpec",
    "KVTransfer",
    "Model",
    "NetworkPolicySpec",
    "Parallelism",
    "Router",
    "SpecError",
    "Toleration",
    "WorkerRole",
    "to_json",
]
