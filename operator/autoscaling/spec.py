"""`spec.autoscaling` as the planner reads it: the typed API declared once in tandem.operator.spec.

Re-exported here so the planner's callers (the operator, the simulator in bench/) import the spec
from where the planner lives; the declarations, defaults and CRD rules are in
operator/spec/autoscaling.py.
"""

from tandem.operator.spec.autoscaling import (
    MAX_REPLICAS,
    ROLES,
    AutoscalingSpec,
    Behavior,
    LatencyTarget,
    Mode,
    PrefillScaling,
    RoleScaling,
    Targets,
)

__all__ = ["MAX_REPLICAS", "ROLES", "AutoscalingSpec", "Behavior", "LatencyTarget", "Mode", "PrefillScaling",
           "RoleScaling", "Targets"]
