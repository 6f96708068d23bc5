"""`tandem up --model`: a folder as it is, or a hub id downloaded once into Hugging Face's cache.

A hub id is `org/name`, optionally `@revision` (a branch, tag or commit). The files land in the
usual cache (HF_HOME, ~/.cache/huggingface), so a second `tandem up` starts from disk; offline,
a cached copy is used, and without one the message says what to do instead.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from tandem.weights.hub import HubError, HubProblem, endpoint_from_env, translated_errors

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9][A-Za-z0-9._/-]*)?$")


def is_hub_id(arg: str) -> bool:
    """org/name[@revision] that names no existing path."""
    return bool(HUB_ID.match(arg)) and not Path(arg).expanduser().exists()


def model_folder(arg: str) -> Path:
    """The folder to serve: `arg` itself, or the hub id's snapshot (downloaded if not cached).

    Raises HubError; for an unreachable hub without a cached copy, the message says how to go on.
    """
    if not is_hub_id(arg):
        return Path(arg).expanduser()
    from huggingface_hub import snapshot_download

    repo, _, revision = arg.partition("@")
    endpoint = endpoint_from_env()
    try:
        with translated_errors(repo, revision or "main", endpoint):
            return Path(snapshot_download(repo, revision=revision or None, endpoint=endpoint))
    except HubError as e:
        if e.reason is not HubProblem.UNREACHABLE:
            raise
        try:
            cached = Path(snapshot_download(repo, revision=revision or None, local_files_only=True))
        except Exception:  # noqa: BLE001 - no cached copy, whatever the library says about it
            raise HubError(HubProblem.UNREACHABLE, f"{e}\nThis machine looks offline and has no copy of {arg} "
                           "in its Hugging Face cache: download it where the hub is reachable and pass "
                           "--model DIR, or set HF_ENDPOINT to a mirror this machine reaches.") from None
        print(f"tandem up: {endpoint} is unreachable; serving the cached copy of {arg} ({cached})",
              file=sys.stderr, flush=True)
        return cached
