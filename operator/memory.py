"""What the operator remembers of one InferenceService between its passes (kept by the controller,
per service, dropped when it is deleted; nothing here survives a restart, nor needs to)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.operator.children import Applied
from tandem.operator.observe import Owners


@dataclass
class Memory:
    """What a pass remembers of the service between passes."""

    # the conditions' reasons that earn a Warning, as last written: one Warning per transition
    warned: dict[str, str] = field(default_factory=dict)
    owners: Owners = field(default_factory=dict)  # the owner chain's controllers, read once each
    applied: dict[str, Applied] = field(default_factory=dict)  # what each child was applied as
    pruned: tuple[str, ...] | None = None  # the stale kinds last pruned (a role changing kind prunes again)
    # status.internalSecret as this process created it: a pass that fails after creating the Secret
    # (before its status write) must not find it "created by someone else" next time
    secret: dict[str, str] | None = None
    # time.monotonic() when a pass last made sure the internal Secret exists (create-if-absent): a
    # settled pass does so only every SECRET_CHECK_RESYNCS resyncs (act.secret_due)
    secret_checked: float | None = None
    version: str | None = None  # the InferenceService's resourceVersion as the last pass read or wrote it
    # (the InferenceService's resourceVersion, watch.Seen.fingerprint) when a pass last found every
    # child as rendered: while both hold, nothing needs rendering again
    settled: tuple[str | None, frozenset] | None = None
    # (what names the spec as stored, conclude._spec_key; the typed spec or None; why it cannot be
    # used): a spec is parsed once, not every pass (parsing costs milliseconds, an idle pass less)
    parsed: tuple[str, Any, str | None] | None = None
