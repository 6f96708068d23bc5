"""The per-InferenceService internal secret: how workers and the router prove they belong to one service.

The contract every process of a service shares (the operator fills the environment from a
Secret it owns, `tandem up` generates one; nothing ever passes it on argv, which `ps` shows):

- The secret reaches a process as the environment variable SECRET_ENV, or as a file
  (a mounted Secret) named by the worker's `internal_secret_file` setting.
- HTTP: every /internal/* endpoint of a worker except PUBLIC_INTERNAL_PATHS wants
  `Authorization: Bearer <secret>` (auth_headers) and answers 401 in OpenAI's error format
  otherwise. /health, /ready, /metrics and /v1/models stay open.
- KV over TCP: a mutual HMAC challenge-response keyed by the secret opens every connection
  (worker/kv/tcp.py); the secret itself never crosses the wire.
- A process without a secret serves as before (no checks) and warns at start-up.

Torch-free and aiohttp-free: the router and the operator import it.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from pathlib import Path

SECRET_ENV = "TANDEM_INTERNAL_SECRET"
MIN_SECRET_CHARS = 16  # a secret shorter than this is a misconfiguration, refused at start-up
AUTH_HEADER = "Authorization"
# Read by the operator's KVTransferReady probe, which never reads Secrets (least privilege):
# counters and the transport in use, no KV data and no request content.
PUBLIC_INTERNAL_PATHS = frozenset({"/internal/kv/health"})


def auth_headers(secret: str | None) -> dict[str, str]:
    """The header that proves membership of the service on an internal call ({} without a secret)."""
    return {AUTH_HEADER: f"Bearer {secret}"} if secret else {}


def bearer_matches(header: str | None, secret: str) -> bool:
    """Whether an Authorization header carries `secret`; constant time in the secret's content."""
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), secret.encode())


def needs_secret(path: str) -> bool:
    """Whether a worker path moves data or changes state, so it is only for the service's own processes."""
    return path.startswith("/internal/") and path not in PUBLIC_INTERNAL_PATHS


def load_secret(env: Mapping[str, str], path: str | None) -> str | None:
    """The secret from `path` (when set; it wins) or from env[SECRET_ENV]; None when neither is set.
    ValueError (naming the source, never the value) for an empty or too short secret."""
    if path:
        secret, source = Path(path).read_text().strip(), f"internal_secret_file {path}"
    elif env.get(SECRET_ENV) is not None:
        secret, source = env[SECRET_ENV].strip(), f"${SECRET_ENV}"
    else:
        return None
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"{source}: the internal secret must be at least {MIN_SECRET_CHARS} characters "
                         f"(got {len(secret)}); generate one with `python -c 'import secrets; "
                         "print(secrets.token_urlsafe(32))'`")
    return secret
