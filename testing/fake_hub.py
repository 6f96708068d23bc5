"""A local server speaking the part of the Hugging Face hub's HTTP API that downloads use.

The hub cannot be reached from the test machines; `huggingface_hub` honours HF_ENDPOINT, so tests
point it (and every process they start) here. It serves model folders the tests build, at commits
it names (sha1 of the files), with branches and tags that resolve to them, and gated repos that
want a token:

  GET  /api/models/<repo>[/revision/<rev>]          model info: id, sha, siblings   (repo_info)
  GET  /api/models/<repo>/tree/<rev>[/<path>]       the files at a commit           (list_repo_tree)
  HEAD /<repo>/resolve/<rev>/<path>                 X-Repo-Commit, ETag, size       (file metadata)
  GET  /<repo>/resolve/<rev>/<path>                 the file                        (hf_hub_download)

Errors carry the hub's X-Error-Code (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo),
which huggingface_hub turns into its own exceptions. Every request is recorded (method, path,
whether it carried a token), so a test can count downloads.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


@dataclass
class Repo:
    """One model repo: its files at one commit, the refs naming that commit, an optional gate."""

    files: dict[str, bytes]
    refs: tuple[str, ...] = ("main",)
    token: str | None = None  # gated: requests must send `Authorization: Bearer <token>`
    commit: str = field(init=False)

    def __post_init__(self) -> None:
        digest = hashlib.sha1()
        for path in sorted(self.files):
            digest.update(path.encode() + b"\0" + self.files[path])
        self.commit = digest.hexdigest()

    @classmethod
    def from_folder(cls, folder: Path, **kwargs: object) -> Repo:
        """Every file under `folder` (a saved Hugging Face model), by its relative path."""
        files = {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        return cls(files, **kwargs)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    authorized: bool


class FakeHub:
    """The server, on a free loopback port in a daemon thread; `url` is what HF_ENDPOINT takes."""

    def __init__(self, repos: dict[str, Repo]) -> None:
        self.repos = repos
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                hub._handle(self, body=True)

            def do_HEAD(self) -> None:  # noqa: N802
                hub._handle(self, body=False)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="fake-hub", daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def downloads(self, repo: str, filename: str) -> int:
        """How many times a file's content was fetched (GET, not HEAD)."""
        suffix = f"/{filename}"
        return sum(1 for r in self.requests if r.method == "GET" and r.path.startswith(f"/{repo}/resolve/")
                   and r.path.endswith(suffix))

    # -- the API ------------------------------------------------------------

    def _handle(self, req: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(req.path).path)
        token = (req.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
        with self._lock:
            self.requests.append(Request(req.command, path, bool(token)))
        try:
            status, headers, payload = self._route(path, token)
        except _HubError as e:
            status, headers, payload = e.status, {"X-Error-Code": e.code}, json.dumps({"error": e.message}).encode()
            headers["Content-Type"] = "application/json"
        req.send_response(status)
        for key, value in headers.items():
            req.send_header(key, value)
        req.send_header("Content-Length", headers.get("Content-Length", str(len(payload))))
        req.end_headers()
        if body:
            req.wfile.write(payload)

    def _route(self, path: str, token: str) -> tuple[int, dict[str, str], bytes]:
        if path.startswith("/api/models/"):
            parts = path.removeprefix("/api/models/").split("/")
            repo_id, repo = self._repo("/".join(parts[:2]), token)
            rest = parts[2:]
            if not rest or rest[0] == "revision":
                self._commit(repo, rest[1] if len(rest) > 1 else "main")
                return self._json({"id": repo_id, "modelId": repo_id, "sha": repo.commit, "private": False,
                                   "gated": "manual" if repo.token else False, "tags": [],
                                   "siblings": [{"rfilename": f} for f in sorted(repo.files)]})
            if rest[0] == "tree":
                self._commit(repo, rest[1])
                prefix = "/".join(rest[2:])
                return self._json([{"type": "file", "path": f, "size": len(data),
                                    "oid": hashlib.sha1(data).hexdigest()}
                                   for f, data in sorted(repo.files.items()) if f.startswith(prefix)])
        parts = path.strip("/").split("/")
        if len(parts) >= 5 and parts[2] == "resolve":
            repo_id, repo = self._repo("/".join(parts[:2]), token)
            commit = self._commit(repo, parts[3])
            filename = "/".join(parts[4:])
            if filename not in repo.files:
                raise _HubError(404, "EntryNotFound", f"{filename} not in {repo_id}")
            data = repo.files[filename]
            return 200, {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                         "Content-Type": "application/octet-stream", "Content-Length": str(len(data))}, data
        raise _HubError(404, "EntryNotFound", f"no such endpoint {path}")

    def _repo(self, repo_id: str, token: str) -> tuple[str, Repo]:
        repo = self.repos.get(repo_id)
        if repo is None:
            raise _HubError(404, "RepoNotFound", f"Repository Not Found for url: {repo_id}")
        if repo.token is not None and token != repo.token:
            raise _HubError(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have access "
                            "to it and be authenticated to access it.")
        return repo_id, repo

    @staticmethod
    def _commit(repo: Repo, revision: str) -> str:
        if revision in repo.refs or revision == repo.commit:
            return repo.commit
        raise _HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")

    @staticmethod
    def _json(value: object) -> tuple[int, dict[str, str], bytes]:
        return 200, {"Content-Type": "application/json"}, json.dumps(value).encode()


class _HubError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
