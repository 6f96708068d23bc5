"""Static discovery: the URLs given on the command line (local mode, `tandem up`)."""

from __future__ import annotations

from tandem.contracts.names import Role
from tandem.router.workers import Target


def static_targets(prefill: list[str], decode: list[str]) -> list[Target]:
    """Role hints from the flag used; the worker's /internal/info has the last word (colocated)."""
    targets = [Target(url.rstrip("/"), Role.PREFILL) for url in prefill]
    targets += [Target(url.rstrip("/"), Role.DECODE) for url in decode]
    return targets
