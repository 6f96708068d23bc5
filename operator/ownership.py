"""Whose an object is: the operator takes over nothing another owner holds (issue 21.6). Pure.

Server-side apply with force would take over any object that happens to have a child's name (and the
garbage collector would later delete it with the InferenceService). So before applying a child the
operator reads it, and an existing one counts as its own only when the InferenceService (this uid)
controls it. The internal Secret the operator never reads: it counts as its own when this operator
created it (a 201 answer, its uid then kept in status.internalSecret), or when an earlier operator
reconciled the service (status.observedGeneration) and so created it first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

REFUSED = "AdoptionRefused"  # Ready's reason, and the Warning event's


@dataclass(frozen=True)
class Refusal:
    """Why an existing object is not taken over; `retryable` when time (the garbage collector) heals it."""

    message: str
    retryable: bool = False


def _controller(obj: dict[str, Any]) -> dict[str, Any] | None:
    return next((r for r in (obj.get("metadata") or {}).get("ownerReferences") or [] if r.get("controller")), None)


def refusal(live: dict[str, Any], manifest: dict[str, Any]) -> Refusal | None:
    """None when `live` (the stored object a child's manifest names) is this InferenceService's own."""
    owner = manifest["metadata"]["ownerReferences"][0]
    what = f"{manifest['kind']}/{manifest['metadata']['name']}"
    ref = _controller(live)
    if ref is not None and ref.get("uid") == owner["uid"]:
        return None
    if (manifest["kind"], ref and ref.get("kind"), ref and ref.get("name")) == (
            "Service", "LeaderWorkerSet", manifest["metadata"]["name"]):
        # A group role's headless Service has its LeaderWorkerSet's name, and the LWS controller makes
        # one when it finds none: ours through our LeaderWorkerSet (a foreign LWS of that name is
        # refused when the operator applies its own).
        return None
    if ref is not None and (ref.get("kind"), ref.get("name")) == (owner["kind"], owner["name"]):
        return Refusal(f"{what} belongs to an earlier {owner['kind']} named {owner['name']} (uid {ref.get('uid')}) "
                       "that the garbage collector has not removed yet", retryable=True)
    holder = f"is controlled by {ref.get('kind')}/{ref.get('name')}" if ref is not None else "has no controller"
    return Refusal(f"{what} exists and {holder}: the operator does not take over objects it did not create; "
                   f"delete or rename it, or give the {owner['kind']} another name")


def secret_record(name: str, created_uid: str | None, old_status: dict[str, Any] | None
                  ) -> tuple[dict[str, str] | None, Refusal | None]:
    """status.internalSecret after creating the Secret `name` (201: `created_uid`) or finding it there
    (409: created_uid None), or why the existing one is not used."""
    old_status = old_status or {}
    if created_uid is not None:
        return {"name": name, "uid": created_uid}, None
    record = old_status.get("internalSecret")
    if isinstance(record, dict) and record.get("name") == name:
        return record, None
    if old_status.get("observedGeneration") is not None:
        return {"name": name}, None  # created by an operator that kept no record, before its first apply
    return None, Refusal(f"Secret/{name} exists but this operator did not create it, so its value may be known "
                         "to someone else: delete it and the operator creates a fresh one")
