"""What crosses between the ranks of a tensor-parallel group: JSON, sealed with the service's secret.

Two channels carry it: the rendezvous store (the agreement and each rank's endpoint) and rank 0's
broadcast of every step. Neither ever carries pickle: a value that a stranger wrote first into the
store, or slipped into a broadcast, would otherwise run as code in the worker. Every value is an
HMAC-SHA256 tag keyed by the internal secret followed by its JSON; a rank opens a value only when
the tag matches, so a process without the secret can neither forge nor alter one (without a secret,
as in a bare `tandem worker`, the tag still catches corruption and the JSON still runs no code).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import asdict, fields, is_dataclass
from typing import Any

_TAG = hashlib.sha256().digest_size


class SealBroken(ValueError):
    """A value between ranks did not come from this group (wrong tag) or is not what was sent."""


def _key(secret: str | None) -> bytes:
    return (secret or "").encode()


def seal(value: Any, secret: str | None) -> bytes:
    """`value` (JSON-able, or a dataclass of JSON-able fields) as tag + JSON bytes."""
    body = json.dumps(asdict(value) if is_dataclass(value) else value, separators=(",", ":"),
                      allow_nan=False).encode()
    return hmac.new(_key(secret), body, hashlib.sha256).digest() + body


def unseal(data: bytes, secret: str | None, what: str) -> Any:
    """The JSON value in `data`; SealBroken (naming `what`) when its tag is not this group's."""
    tag, body = bytes(data[:_TAG]), bytes(data[_TAG:])
    if len(data) < _TAG or not hmac.compare_digest(tag, hmac.new(_key(secret), body, hashlib.sha256).digest()):
        raise SealBroken(f"{what}: not sealed with this service's internal secret (a process outside the "
                         "group wrote it, or the ranks were started with different secrets)")
    try:
        return json.loads(body)
    except ValueError as e:
        raise SealBroken(f"{what}: sealed but not JSON ({e})") from e


def from_fields(cls: type, value: Any, what: str) -> Any:
    """A dataclass `cls` from an unsealed JSON object, refusing unknown or missing fields."""
    names = {f.name for f in fields(cls)}
    if not isinstance(value, dict) or not set(value) <= names:
        raise SealBroken(f"{what}: expected the fields of {cls.__name__}, got "
                         f"{sorted(value) if isinstance(value, dict) else type(value).__name__}")
    try:
        return cls(**value)
    except TypeError as e:
        raise SealBroken(f"{what}: {e}") from e
