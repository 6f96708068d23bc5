"""`spec.autoscaling`: the typed API and the OpenAPI schema the CRD carries for it.

The schema (SCHEMA) is the one source of the defaults: `AutoscalingSpec.from_dict` applies the
same defaults the API server does, so a spec read by the operator, a unit test and the simulator
mean the same thing. A role left out of `spec.autoscaling` keeps its fixed `spec.<role>.replicas`.

    autoscaling:
      intervalSeconds: 15        # one decision per interval
      windowSeconds: 60          # rates and percentiles are taken over this much history
      tolerance: 0.1             # a latency ratio within 10% of its target changes nothing
      targets:
        ttft: {seconds: 2, percentile: 90}     # time to first token, at the router
        itl:  {seconds: 0.1, percentile: 90}   # gap between tokens, at the router
      prefill:                   # may go to 0: decode workers then prefill themselves
        minReplicas: 0
        maxReplicas: 8
        targetUtilization: 0.8   # busy fraction the prefill pool is sized for, ahead of TTFT
      decode:
        mode: External           # an HPA or KEDA owns decode replicas; the operator stops writing them
"""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass
from typing import Any

ROLES = ("prefill", "decode")
MAX_REPLICAS = 1000  # the CRD's bound on spec.<role>.replicas


class Mode(enum.StrEnum):
    """Who owns a role's replicas."""

    OPERATOR = "Operator"  # the planner decides and the operator writes them
    EXTERNAL = "External"  # an HPA/KEDA decides; the operator applies the Deployment without the field


def _int(lo: int, hi: int, default: int | None, description: str) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "integer", "minimum": lo, "maximum": hi, "description": description}
    if default is not None:
        out["default"] = default
    return out


def _number(lo: float, hi: float, default: float, description: str, exclusive_min: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "number", "minimum": lo, "maximum": hi, "default": default,
                           "description": description}
    if exclusive_min:
        out["exclusiveMinimum"] = True
    return out


def _target(what: str, seconds: float, hi: float) -> dict[str, Any]:
    return {
        "type": "object",
        "default": {},
        "description": f"{what.capitalize()} at a percentile, measured at the router over windowSeconds.",
        "properties": {
            "seconds": _number(0, hi, seconds, f"The {what} the percentile must stay under.", exclusive_min=True),
            "percentile": _number(50, 99.9, 90, "Which percentile (50-99.9) is held to the target."),
        },
    }


def _behavior(direction: str, window: int, step: int, percent: int) -> dict[str, Any]:
    verb = "added" if direction == "up" else "removed"
    pick = "lowest" if direction == "up" else "highest"
    return {
        "type": "object",
        "default": {},
        "description": f"How fast the role scales {direction}.",
        "properties": {
            "stabilizationWindowSeconds": _int(
                0, 3600, window,
                f"The planner acts on the {pick} recommendation of this many past seconds, so a "
                f"short spike or dip does not move replicas."),
            "maxStep": _int(1, MAX_REPLICAS, step, f"Most replicas {verb} in one decision."),
            "maxStepPercent": _int(
                1, 1000, percent,
                f"Most replicas {verb} in one decision as a percentage of the current count; "
                f"the larger of maxStep and this applies."),
        },
    }


def _role(role: str) -> dict[str, Any]:
    floor = 0 if role == "prefill" else 1
    props: dict[str, Any] = {
        "mode": {"type": "string", "enum": [m.value for m in Mode], "default": Mode.OPERATOR.value,
                 "description": "Operator: the planner decides this role's replicas. External: an HPA "
                                "or KEDA does, and the operator stops writing the Deployment's replicas."},
        "minReplicas": _int(0, MAX_REPLICAS, floor, f"Fewest {role} pods the planner keeps."),
        "maxReplicas": _int(0, MAX_REPLICAS, None, f"Most {role} pods the planner runs (required in Operator mode)."),
        "scaleUp": _behavior("up", 0, 4, 100),
        "scaleDown": _behavior("down", 300, 1, 20),
    }
    if role == "prefill":
        props["targetUtilization"] = _number(
            0.1, 1.0, 0.8,
            "Busy fraction the prefill pool is sized for from the prompt load, before TTFT suffers.")
    rules = [
        {"rule": "self.mode == 'External' || has(self.maxReplicas)",
         "message": f"autoscaling.{role}.maxReplicas is required when autoscaling.{role}.mode is Operator"},
        {"rule": "!has(self.maxReplicas) || self.minReplicas <= self.maxReplicas",
         "message": f"autoscaling.{role}.minReplicas must not exceed autoscaling.{role}.maxReplicas"},
    ]
    if role == "decode":
        rules.append({"rule": "self.minReplicas >= 1 && (!has(self.maxReplicas) || self.maxReplicas >= 1)",
                      "message": "autoscaling.decode.minReplicas and maxReplicas must be at least 1: only "
                                 "decode workers can serve (prefill may scale to 0)"})
    what = ("prefill workers (may go to 0: decode workers then prefill prompts themselves)"
            if role == "prefill" else "decode workers")
    return {"type": "object", "description": f"How the planner sizes the {what}; leave out to keep "
            f"spec.{role}.replicas fixed.", "properties": props, "x-kubernetes-validations": rules}


# spec.autoscaling, for the CRD generator to place under spec.properties.autoscaling.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "Scale prefill and decode apart against latency targets. A role left out keeps its "
                   "fixed replicas.",
    "properties": {
        "intervalSeconds": _int(5, 600, 15, "Seconds between two decisions."),
        "windowSeconds": _int(10, 3600, 60, "Seconds of metrics each decision looks at (rates, percentiles)."),
        "tolerance": _number(0, 0.5, 0.1, "A latency within this fraction of its target moves nothing."),
        "targets": {
            "type": "object",
            "default": {},
            "description": "Latency targets, measured at the router where the client sees them.",
            "properties": {
                "ttft": _target("time to first token", 2.0, 600),
                "itl": _target("inter-token latency", 0.1, 60),
            },
        },
        "prefill": _role("prefill"),
        "decode": _role("decode"),
    },
    "x-kubernetes-validations": [
        {"rule": "has(self.prefill) || has(self.decode)",
         "message": "autoscaling: configure prefill, decode or both (a role left out keeps its fixed replicas)"},
        {"rule": "self.windowSeconds >= self.intervalSeconds",
         "message": "autoscaling.windowSeconds must be at least intervalSeconds: each decision needs a whole "
                    "interval of metrics"},
    ],
}


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """The API server's structural defaulting: a missing property takes its `default`, recursively."""
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(sub, value[key])
    return value


@dataclass(frozen=True)
class LatencyTarget:
    seconds: float
    percentile: float  # 50..99.9

    @property
    def quantile(self) -> float:
        return self.percentile / 100.0


@dataclass(frozen=True)
class Behavior:
    stabilization_s: float
    max_step: int
    max_step_percent: int

    def step_limit(self, current: int) -> int:
        """Most replicas one decision may move from `current` (the larger of the two limits)."""
        return max(self.max_step, -(-current * self.max_step_percent // 100))


@dataclass(frozen=True)
class RoleScaling:
    mode: Mode
    min_replicas: int
    max_replicas: int | None  # None only in External mode
    scale_up: Behavior
    scale_down: Behavior
    target_utilization: float = 0.8  # prefill only

    def clamp(self, n: int) -> int:
        hi = self.max_replicas if self.max_replicas is not None else MAX_REPLICAS
        return max(self.min_replicas, min(hi, n))


@dataclass(frozen=True)
class AutoscalingSpec:
    interval_s: float
    window_s: float
    tolerance: float
    ttft: LatencyTarget
    itl: LatencyTarget
    roles: dict[str, RoleScaling]  # only the roles that are autoscaled

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AutoscalingSpec:
        """From `spec.autoscaling` as stored (or as written: the CRD's defaults are applied here too)."""
        d = apply_defaults(SCHEMA, copy.deepcopy(d))
        roles = {}
        for role in ROLES:
            r = d.get(role)
            if r is None:
                continue
            mode = Mode(r["mode"])
            hi = r.get("maxReplicas")
            if hi is None and mode is Mode.OPERATOR:
                raise ValueError(f"autoscaling.{role}.maxReplicas is required when mode is Operator")
            if hi is not None and r["minReplicas"] > hi:
                raise ValueError(f"autoscaling.{role}.minReplicas must not exceed maxReplicas")
            roles[role] = RoleScaling(
                mode=mode, min_replicas=int(r["minReplicas"]), max_replicas=None if hi is None else int(hi),
                scale_up=_behavior_of(r["scaleUp"]), scale_down=_behavior_of(r["scaleDown"]),
                target_utilization=float(r.get("targetUtilization", 0.8)),
            )
        if not roles:
            raise ValueError("autoscaling: configure prefill, decode or both")
        t = d["targets"]
        return cls(
            interval_s=float(d["intervalSeconds"]), window_s=float(d["windowSeconds"]),
            tolerance=float(d["tolerance"]),
            ttft=LatencyTarget(float(t["ttft"]["seconds"]), float(t["ttft"]["percentile"])),
            itl=LatencyTarget(float(t["itl"]["seconds"]), float(t["itl"]["percentile"])),
            roles=roles,
        )


def _behavior_of(b: dict[str, Any]) -> Behavior:
    return Behavior(float(b["stabilizationWindowSeconds"]), int(b["maxStep"]), int(b["maxStepPercent"]))
