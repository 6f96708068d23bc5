"""Where Tandem keeps what it builds or downloads once on this machine (toy models, the compile
cache, vLLM's environment, Kubernetes binaries): ~/.cache/tandem/, or $TANDEM_CACHE."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "TANDEM_CACHE"


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "tandem")
