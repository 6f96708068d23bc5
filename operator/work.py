"""What one pass over an InferenceService must do, as the triggers ask for it. Pure.

Every pass reads the InferenceService afresh, observes its children and writes status if it
changed; `apply` adds rendering and applying the children, `plan` adds the planner's decision.
Two requests for the same key merge into one pass that does both.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Trigger(enum.StrEnum):
    """Who asked for a pass (a label of the operator's metrics; merged passes keep the strongest)."""

    SPEC = "spec"  # created, changed, or seen at start-up
    RETRY = "retry"  # an apply that failed in a way retrying can fix
    RESYNC = "resync"  # the periodic drift correction
    PLANNER = "planner"  # spec.autoscaling's interval came round
    CHILD = "child"  # a Deployment or pod of the service changed


# A merged pass is reported as the first of these among its triggers.
PRIORITY = (Trigger.SPEC, Trigger.RETRY, Trigger.PLANNER, Trigger.RESYNC, Trigger.CHILD)


@dataclass(frozen=True)
class Work:
    """A request for one pass: status always; children applied with `apply`; a decision with `plan`."""

    trigger: Trigger
    apply: bool = False
    plan: bool = False

    @property
    def drift(self) -> bool:
        """An apply nobody asked for by changing the spec: what it changes was drift."""
        return self.apply and self.trigger not in (Trigger.SPEC, Trigger.RETRY)


SPEC = Work(Trigger.SPEC, apply=True)
RETRY = Work(Trigger.RETRY, apply=True)
RESYNC = Work(Trigger.RESYNC, apply=True)
PLAN = Work(Trigger.PLANNER, plan=True)
STATUS = Work(Trigger.CHILD)


def merge(a: Work, b: Work) -> Work:
    """One pass that does what both asked for."""
    trigger = min(a.trigger, b.trigger, key=PRIORITY.index)
    return Work(trigger, apply=a.apply or b.apply, plan=a.plan or b.plan)
