"""`spec.autoscaling`, declared once: the planner reads the same typed object the renderer does.

Each field is one `api_field` line, so the CRD's schema (defaults, bounds, CEL rules and their
messages) and the parser cannot drift apart. The rules the planner cannot work without carry their
Python twin (`Rule.check`), so a CRD older than the operator still cannot hand it a broken spec.
A role left out of `spec.autoscaling` keeps its fixed `spec.<role>.replicas`.

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

import enum
from dataclasses import dataclass
from typing import Any, ClassVar

from tandem.operator.spec.fields import Rule, api_field, parse

ROLES = ("prefill", "decode")
MAX_REPLICAS = 1000  # the CRD's bound on spec.<role>.replicas
api_type = dataclass(frozen=True, kw_only=True)


class Mode(enum.StrEnum):
    """Who owns a role's replicas."""

    OPERATOR = "Operator"  # the planner decides and the operator writes them
    EXTERNAL = "External"  # an HPA/KEDA decides; the operator applies the Deployment without the field


@api_type
class LatencyTarget:
    """A latency at a percentile (`{what}` in a text is the latency's name)."""

    seconds: float = api_field(
        "seconds", minimum=0, exclusive_minimum=True, description="The {what} the percentile must stay under.")
    percentile: float = api_field(
        "percentile", minimum=50, maximum=99.9, default=90,
        description="Which percentile (50-99.9) is held to the target.")

    @property
    def quantile(self) -> float:
        return self.percentile / 100.0


def _target(name: str, what: str, seconds: float, most: float) -> Any:
    return api_field(
        name, default={}, context={"what": what},
        description=f"{what.capitalize()} at a percentile, measured at the router over windowSeconds.",
        overrides={"seconds": {"default": seconds,
                               "constraints": {"minimum": 0, "exclusiveMinimum": True, "maximum": most}}})


@api_type
class Targets:
    """Latency targets, measured at the router where the client sees them."""

    ttft: LatencyTarget = _target("ttft", "time to first token", 2.0, 600)
    itl: LatencyTarget = _target("itl", "inter-token latency", 0.1, 60)


@api_type
class Behavior:
    """How fast a role moves one way (`{verb}` and `{pick}` in a text say which way)."""

    stabilization_s: int = api_field(
        "stabilizationWindowSeconds", minimum=0, maximum=3600,
        description="The planner acts on the {pick} recommendation of this many past seconds, so a short "
        "spike or dip does not move replicas.")
    max_step: int = api_field(
        "maxStep", minimum=1, maximum=MAX_REPLICAS, description="Most replicas {verb} in one decision.")
    max_step_percent: int = api_field(
        "maxStepPercent", minimum=1, maximum=1000,
        description="Most replicas {verb} in one decision as a percentage of the current count; the larger "
        "of maxStep and this applies.")

    def step_limit(self, current: int) -> int:
        """Most replicas one decision may move from `current` (the larger of the two limits)."""
        return max(self.max_step, -(-current * self.max_step_percent // 100))


def _behavior(direction: str, window: int, step: int, percent: int) -> Any:
    verb, pick = ("added", "lowest") if direction == "up" else ("removed", "highest")
    return api_field(
        f"scale{direction.capitalize()}", default={}, description=f"How fast the role scales {direction}.",
        context={"verb": verb, "pick": pick},
        overrides={"stabilizationWindowSeconds": {"default": window}, "maxStep": {"default": step},
                   "maxStepPercent": {"default": percent}})


@api_type
class RoleScaling:
    """How the planner sizes one role (`{role}` in a text is its name)."""

    mode: Mode = api_field(
        "mode", default=Mode.OPERATOR.value,
        description="Operator: the planner decides this role's replicas. External: an HPA or KEDA does, "
        "and the operator stops writing the Deployment's replicas.")
    min_replicas: int = api_field(
        "minReplicas", minimum=0, maximum=MAX_REPLICAS, description="Fewest {role} pods the planner keeps.")
    max_replicas: int | None = api_field(
        "maxReplicas", minimum=0, maximum=MAX_REPLICAS,
        description="Most {role} pods the planner runs (required in Operator mode).")
    scale_up: Behavior = _behavior("up", 0, 4, 100)
    scale_down: Behavior = _behavior("down", 300, 1, 20)

    RULES: ClassVar[tuple[Rule, ...]] = (
        Rule("self.mode == 'External' || has(self.maxReplicas)",
             "autoscaling.{role}.maxReplicas is required when autoscaling.{role}.mode is Operator",
             check=lambda r: r.mode is Mode.EXTERNAL or r.max_replicas is not None),
        Rule("!has(self.maxReplicas) || self.minReplicas <= self.maxReplicas",
             "autoscaling.{role}.minReplicas must not exceed autoscaling.{role}.maxReplicas",
             check=lambda r: r.max_replicas is None or r.min_replicas <= r.max_replicas),
    )

    def clamp(self, n: int) -> int:
        hi = self.max_replicas if self.max_replicas is not None else MAX_REPLICAS
        return max(self.min_replicas, min(hi, n))


@api_type
class PrefillScaling(RoleScaling):
    """How the planner sizes the prefill pool: as any role, plus the busy fraction it aims at."""

    target_utilization: float = api_field(
        "targetUtilization", minimum=0.1, maximum=1.0, default=0.8,
        description="Busy fraction the prefill pool is sized for from the prompt load, before TTFT suffers.")


DECODE_SERVES = Rule(
    "self.minReplicas >= 1 && (!has(self.maxReplicas) || self.maxReplicas >= 1)",
    "autoscaling.decode.minReplicas and maxReplicas must be at least 1: only decode workers can serve "
    "(prefill may scale to 0)",
    check=lambda r: r.min_replicas >= 1 and (r.max_replicas is None or r.max_replicas >= 1))


@api_type
class AutoscalingSpec:
    """Scale prefill and decode apart against latency targets; the whole `spec.autoscaling`."""

    interval_s: int = api_field(
        "intervalSeconds", minimum=5, maximum=600, default=15, description="Seconds between two decisions.")
    window_s: int = api_field(
        "windowSeconds", minimum=10, maximum=3600, default=60,
        description="Seconds of metrics each decision looks at (rates, percentiles).")
    tolerance: float = api_field(
        "tolerance", minimum=0, maximum=0.5, default=0.1,
        description="A latency within this fraction of its target moves nothing.")
    targets: Targets = api_field(
        "targets", default={}, description="Latency targets, measured at the router where the client sees them.")
    prefill: PrefillScaling | None = api_field(
        "prefill", context={"role": "prefill"}, overrides={"minReplicas": {"default": 0}},
        description="How the planner sizes the prefill workers (may go to 0: decode workers then prefill "
        "prompts themselves); leave out to keep spec.prefill.replicas fixed.")
    decode: RoleScaling | None = api_field(
        "decode", context={"role": "decode"}, overrides={"minReplicas": {"default": 1}}, rules=(DECODE_SERVES,),
        description="How the planner sizes the decode workers; leave out to keep spec.decode.replicas fixed.")

    RULES: ClassVar[tuple[Rule, ...]] = (
        Rule("has(self.prefill) || has(self.decode)",
             "autoscaling: configure prefill, decode or both (a role left out keeps its fixed replicas)",
             check=lambda a: a.prefill is not None or a.decode is not None),
        Rule("self.windowSeconds >= self.intervalSeconds",
             "autoscaling.windowSeconds must be at least intervalSeconds: each decision needs a whole "
             "interval of metrics",
             check=lambda a: a.window_s >= a.interval_s),
    )

    @classmethod
    def from_dict(cls, value: Any) -> AutoscalingSpec:
        """`spec.autoscaling` as stored (or as written: the declared defaults fill the gaps).

        Raises SpecError (a ValueError) naming the field, with the CRD's own message for a rule.
        """
        return parse(cls, value, "spec.autoscaling")

    @property
    def roles(self) -> dict[str, RoleScaling]:
        """The autoscaled roles only, by name."""
        return {role: rs for role, rs in (("prefill", self.prefill), ("decode", self.decode)) if rs is not None}

    @property
    def ttft(self) -> LatencyTarget:
        return self.targets.ttft

    @property
    def itl(self) -> LatencyTarget:
        return self.targets.itl

    def owns(self, role: str) -> bool:
        """Whether the planner decides this role's replicas (autoscaled, in Operator mode)."""
        rs = self.roles.get(role)
        return rs is not None and rs.mode is Mode.OPERATOR

    def external(self, role: str) -> bool:
        """Whether an external autoscaler owns this role's replicas (the operator must not write them)."""
        rs = self.roles.get(role)
        return rs is not None and rs.mode is Mode.EXTERNAL
