"""RBAC for the tests that run the operator with least privilege: refusals in its log, and the rules
operator/RBAC.md documents.

Only a refusal by authorization counts ("... is forbidden: User "system:serviceaccount:..."
cannot patch resource ..."), and kopf's "Not enough permissions" warning. Other 403s are not
RBAC: with --all-namespaces the operator also sees other tests' namespaces being deleted, and
the API server refuses new objects there with "forbidden: unable to create new content in
namespace ... because it is being terminated".
"""

from __future__ import annotations

import re
from pathlib import Path

_DENIAL = re.compile(r'forbidden: User \\*"[^"\\]+\\*" cannot ')  # quotes escaped 0, 1 or 2 times


def rbac_denials(log: str) -> list[str]:
    """The log lines that show a permission the operator lacks."""
    return [line for line in log.splitlines()
            if _DENIAL.search(line) or "Not enough permissions" in line]


def rbac_md_rules(path: Path, section: str = "Always") -> list[dict]:
    """The table under `## {section}...` of operator/RBAC.md (`path`), one PolicyRule per row:
    | `group` | `res`, `res` | verb, verb | why |."""
    rules, inside = [], False
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            inside = line[3:].startswith(section)
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not inside or len(cells) != 4 or not cells[0].startswith("`"):
            continue
        group = re.findall(r"`([^`]*)`", cells[0])[0]
        group = "" if group == '""' else group
        resources = re.findall(r"`([^`]+)`", cells[1])
        verbs = [v.strip() for v in cells[2].split(",")]
        rules.append({"apiGroups": [group], "resources": resources, "verbs": verbs})
    return rules
