"""Finding RBAC refusals in an operator's log, for the tests that run it with least privilege.

Only a refusal by authorization counts ("... is forbidden: User "system:serviceaccount:..."
cannot patch resource ..."), and kopf's "Not enough permissions" warning. Other 403s are not
RBAC: with --all-namespaces the operator also sees other tests' namespaces being deleted, and
the API server refuses new objects there with "forbidden: unable to create new content in
namespace ... because it is being terminated".
"""

from __future__ import annotations

import re

_DENIAL = re.compile(r'forbidden: User \\*"[^"\\]+\\*" cannot ')  # quotes escaped 0, 1 or 2 times


def rbac_denials(log: str) -> list[str]:
    """The log lines that show a permission the operator lacks."""
    return [line for line in log.splitlines()
            if _DENIAL.search(line) or "Not enough permissions" in line]
