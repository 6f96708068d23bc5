"""The Pod Security Standards' Restricted level, as a check on a pod spec.

Tests use it on rendered manifests (no API server needed) and on pod templates read back
from the API server. The real PodSecurity admission plugin is the final judge: the
chart's end-to-end test also has the API server itself admit the pods into a namespace
labelled `pod-security.kubernetes.io/enforce=restricted`. The rules mirror
https://kubernetes.io/docs/concepts/security/pod-security-standards/ (Restricted, latest).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# Volume types the Restricted level allows.
ALLOWED_VOLUME_TYPES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
ALLOWED_ADDED_CAPABILITIES = {"NET_BIND_SERVICE"}
ALLOWED_SECCOMP_TYPES = {"RuntimeDefault", "Localhost"}


def _containers(spec: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for field in ("initContainers", "containers", "ephemeralContainers"):
        for c in spec.get(field) or []:
            yield f"{field}[{c.get('name', '?')}]", c


def restricted_violations(spec: dict[str, Any]) -> list[str]:
    """Every way `spec` (a PodSpec as a dict, camelCase keys) breaks the Restricted level."""
    out: list[str] = []
    pod_sc = spec.get("securityContext") or {}

    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            out.append(f"spec.{field} is true")
    for vol in spec.get("volumes") or []:
        kinds = set(vol) - {"name"}
        bad = kinds - ALLOWED_VOLUME_TYPES
        if bad:
            out.append(f"volume {vol.get('name')!r} has type {sorted(bad)}")
    if pod_sc.get("runAsUser") == 0:
        out.append("spec.securityContext.runAsUser is 0")

    pod_non_root = pod_sc.get("runAsNonRoot")
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type")
    if pod_seccomp is not None and pod_seccomp not in ALLOWED_SECCOMP_TYPES:
        out.append(f"spec.securityContext.seccompProfile.type is {pod_seccomp}")

    for where, c in _containers(spec):
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            out.append(f"{where}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{where}: allowPrivilegeEscalation is not false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{where}: capabilities.drop does not include ALL")
        added = set(caps.get("add") or []) - ALLOWED_ADDED_CAPABILITIES
        if added:
            out.append(f"{where}: adds capabilities {sorted(added)}")
        non_root = sc.get("runAsNonRoot", pod_non_root)
        if non_root is not True:
            out.append(f"{where}: runAsNonRoot is not true (container or pod)")
        if sc.get("runAsUser") == 0:
            out.append(f"{where}: runAsUser is 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type", pod_seccomp)
        if seccomp not in ALLOWED_SECCOMP_TYPES:
            out.append(f"{where}: seccompProfile.type is {seccomp} (container or pod)")
        if sc.get("procMount") not in (None, "Default"):
            out.append(f"{where}: procMount is {sc.get('procMount')}")
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                out.append(f"{where}: hostPort {port['hostPort']}")
    return out
