"""The test API server's audit log (testing/control_plane_config.AUDIT_LOG): what a least-privilege
operator (a ServiceAccount in `default`, the chart_rbac fixture) asked of the API server, request by
request, for tests that count calls (an idle pass lists nothing)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tandem.testing.control_plane_config import AUDIT_LOG


@dataclass(frozen=True)
class Call:
    """One completed request: its verb (get, list, watch, create, patch, ...), what it was on, its answer."""

    verb: str
    resource: str  # "pods", "inferenceservices/status", ...
    namespace: str
    name: str
    code: int

    def __str__(self) -> str:
        return f"{self.verb} {self.resource} {self.namespace}/{self.name} -> {self.code}"


class AuditLog:
    """Calls by one user, read from a mark on (the file only grows between marks in a test)."""

    def __init__(self, work_dir: Path, user: str) -> None:
        self.path, self.user = Path(work_dir) / AUDIT_LOG, user

    def mark(self) -> int:
        return self.path.stat().st_size if self.path.exists() else 0

    def since(self, mark: int) -> list[Call]:
        with self.path.open("rb") as f:
            f.seek(mark)
            lines = f.read().splitlines()
        calls = []
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:  # a line being written as we read
                continue
            if event.get("user", {}).get("username") != self.user:
                continue
            ref = event.get("objectRef") or {}
            resource = ref.get("resource", "") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
            calls.append(Call(event.get("verb", ""), resource, ref.get("namespace", ""), ref.get("name", ""),
                              (event.get("responseStatus") or {}).get("code", 0)))
        return calls
