"""The Hugging Face hub, as Tandem uses it: a revision resolved to a commit, a model's config.json
at that commit, and its files downloaded once into a folder the workers read.

Every call takes the endpoint (HF_ENDPOINT: the hub, a mirror, or the tests' fake hub) and the
token (a gated model's; never logged, never in an error message) explicitly, and turns the
library's exceptions into HubError with a reason a status condition can carry.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DEFAULT_ENDPOINT = "https://huggingface.co"
# Written last into a downloaded folder: its presence means every file is there.
COMPLETE_MARKER = ".tandem-complete"
TIMEOUT_S = 10.0


class HubProblem(enum.StrEnum):
    """Why the hub did not give what was asked (a condition's reason)."""

    REPO_NOT_FOUND = "RepoNotFound"
    REVISION_NOT_FOUND = "RevisionNotFound"
    GATED = "GatedRepo"  # a token is missing or has no access
    FILE_NOT_FOUND = "FileNotFound"
    UNREACHABLE = "HubUnreachable"
    DOWNLOAD_FAILED = "DownloadFailed"


# Problems that trying again cannot fix (the repo, revision or file is not there, or the token has no
# access): a download Job fails at once on them instead of retrying for minutes.
PERMANENT = frozenset({HubProblem.REPO_NOT_FOUND, HubProblem.REVISION_NOT_FOUND, HubProblem.GATED,
                       HubProblem.FILE_NOT_FOUND})


class HubError(Exception):
    """A hub request failed; `reason` is a HubProblem, the message says what to do."""

    def __init__(self, reason: HubProblem, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def endpoint_from_env() -> str:
    """HF_ENDPOINT as huggingface_hub reads it, else the public hub."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def snapshot_dir(root: Path, repo: str, commit: str) -> Path:
    """Where a commit's files live under a cache root: <root>/<org>/<name>/<commit>."""
    return Path(root, *repo.split("/"), commit)


@contextlib.contextmanager
def translated_errors(repo: str, revision: str, endpoint: str) -> Iterator[None]:
    """The library's exceptions as HubError (the token is in none of the messages)."""
    from huggingface_hub import errors

    where = f"{repo}@{revision} on {endpoint}"
    try:
        yield
    except errors.GatedRepoError:
        raise HubError(HubProblem.GATED, f"{where} is gated: set model.tokenSecretRef to a Secret holding a "
                       "token of an account that accepted the model's terms") from None
    except errors.RepositoryNotFoundError:
        raise HubError(HubProblem.REPO_NOT_FOUND, f"{repo} does not exist on {endpoint} (or it is private: "
                       "set model.tokenSecretRef)") from None
    except errors.RevisionNotFoundError:
        raise HubError(HubProblem.REVISION_NOT_FOUND, f"{repo} has no revision {revision!r} on {endpoint} "
                       "(a branch, a tag or a commit)") from None
    except errors.RemoteEntryNotFoundError as e:
        raise HubError(HubProblem.FILE_NOT_FOUND, f"{where}: {str(e).splitlines()[-1]}") from None
    except errors.HfHubHTTPError as e:
        raise HubError(HubProblem.UNREACHABLE, f"{where}: the hub answered {e.response.status_code}") from None
    except Exception as e:  # connection refused, DNS, TLS, timeouts (httpx), offline mode
        if isinstance(e, OSError | ConnectionError) or type(e).__module__.startswith("httpx"):
            raise HubError(HubProblem.UNREACHABLE, f"cannot reach {endpoint} for {repo}@{revision}: "
                           f"{type(e).__name__}: {e}") from None
        raise


def resolve_commit(repo: str, revision: str, *, endpoint: str, token: str | None = None,
                   timeout_s: float = TIMEOUT_S) -> str:
    """The commit a branch, tag or commit names now (what the hub's model info says)."""
    from huggingface_hub import HfApi

    with translated_errors(repo, revision, endpoint):
        info = HfApi(endpoint=endpoint).model_info(repo, revision=revision, token=token or False,
                                                   timeout=timeout_s)
    if not info.sha:
        raise HubError(HubProblem.UNREACHABLE, f"{endpoint} named no commit for {repo}@{revision}")
    return info.sha


def fetch_config(repo: str, commit: str, *, endpoint: str, token: str | None = None,
                 timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    """config.json at a commit, without downloading anything else."""
    from huggingface_hub import hf_hub_download

    with tempfile.TemporaryDirectory(prefix="tandem-config-") as tmp, translated_errors(repo, commit, endpoint):
        path = hf_hub_download(repo, "config.json", revision=commit, cache_dir=tmp, token=token or False,
                               endpoint=endpoint, etag_timeout=timeout_s)
        try:
            value = json.loads(Path(path).read_text())
        except ValueError as e:
            raise HubError(HubProblem.FILE_NOT_FOUND, f"{repo}@{commit}: config.json is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise HubError(HubProblem.FILE_NOT_FOUND, f"{repo}@{commit}: config.json is not a JSON object")
    return value


def is_complete(folder: Path) -> bool:
    return (folder / COMPLETE_MARKER).is_file()


def download(repo: str, commit: str, dest: Path, *, endpoint: str, token: str | None = None) -> Path:
    """Every file of `repo` at `commit` into `dest`, once: a folder already complete is left as it
    is; concurrent callers on one filesystem (pods sharing a node's cache) wait for the first."""
    from filelock import FileLock
    from huggingface_hub import snapshot_download

    dest.mkdir(parents=True, exist_ok=True)
    if is_complete(dest):
        return dest
    with FileLock(str(dest) + ".lock"):
        if is_complete(dest):
            return dest
        with translated_errors(repo, commit, endpoint):
            snapshot_download(repo, revision=commit, local_dir=dest, token=token or False, endpoint=endpoint)
        (dest / COMPLETE_MARKER).write_text(json.dumps({"repo": repo, "commit": commit}) + "\n")
    return dest


def wait_complete(folder: Path, timeout_s: float, poll_s: float = 2.0) -> None:
    """Until another process (the download Job) has finished `folder`; TimeoutError names it."""
    deadline = time.monotonic() + timeout_s
    while not is_complete(folder):
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{folder} was not downloaded within {timeout_s:.0f} s "
                               f"(no {COMPLETE_MARKER}): see the InferenceService's download Job")
        time.sleep(poll_s)
