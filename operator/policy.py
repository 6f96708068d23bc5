"""What an InferenceService may ask of a node: the operator's own policy, judged before anything is
rendered. Pure.

Whoever may create an InferenceService gets pods the operator writes for them: a hostPath mount
(read-only for model.hostPath, written for model.cache.hostPath), the node's network, IPC_LOCK (which
runs the worker as root), any image, a ServiceAccount of the namespace. Pod Security admission judges
only a namespace's label, so the operator judges the spec itself, per namespace, against the policy
its admin configured (TANDEM_POLICY, the chart's `policy` values). Secure by default: none of it
unless allowed, and no image but the operator's own worker, router and vLLM worker repositories.

  {"default":    {"hostPaths": [...], "writableHostPaths": [...], "images": [...],
                  "serviceAccounts": [...], "hostNetwork": false, "ipcLock": false,
                  "alwaysPullImages": false},
   "namespaces": {"<namespace>": {<any of the keys above>}}}

A namespace's entry overrides the default key by key (a list replaces the default's list). Paths
are directory prefixes; images are repositories, or prefixes ending in "/"; "*" in images or
serviceAccounts allows any.
"""

from __future__ import annotations

import dataclasses
import json
import posixpath
import re
from dataclasses import dataclass
from typing import Any

from tandem.operator.spec import WORKER_ROLES, InferenceServiceSpec

POLICY_ENV = "TANDEM_POLICY"
DENIED = "PolicyDenied"  # Ready's reason for a spec the policy refuses
ANY = "*"
NAMESPACE = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
ALWAYS = "Always"


class PolicyError(ValueError):
    """A policy the operator cannot read: it refuses to start rather than guess."""


@dataclass(frozen=True)
class Rules:
    """What InferenceServices of one namespace may ask of a node."""

    host_paths: tuple[str, ...] = ()  # model.hostPath (read-only) under these directories
    writable_host_paths: tuple[str, ...] = ()  # model.cache.hostPath (written, created) under these
    images: tuple[str, ...] = ()  # repositories beyond the operator's own ("x/" a prefix, "*" any)
    service_accounts: tuple[str, ...] = ()  # serviceAccountName values allowed ("*" any)
    host_network: bool = False  # kvTransfer.hostNetwork
    ipc_lock: bool = False  # kvTransfer.ipcLock: IPC_LOCK, and so uid 0
    always_pull_images: bool = False  # every image pulled Always; a spec may not ask otherwise


# JSON key -> Rules field
KEYS = {"hostPaths": "host_paths", "writableHostPaths": "writable_host_paths", "images": "images",
        "serviceAccounts": "service_accounts", "hostNetwork": "host_network", "ipcLock": "ipc_lock",
        "alwaysPullImages": "always_pull_images"}
LISTS = ("hostPaths", "writableHostPaths", "images", "serviceAccounts")


@dataclass(frozen=True)
class Violation:
    """One thing a spec asks that the policy does not allow: the field and what to do about it."""

    field: str
    message: str


@dataclass(frozen=True)
class Policy:
    """The cluster-wide rules and, per namespace, the rules that namespace's entry makes of them."""

    default: Rules = Rules()
    namespaces: tuple[tuple[str, Rules], ...] = ()

    def rules(self, namespace: str) -> Rules:
        return dict(self.namespaces).get(namespace, self.default)

    @classmethod
    def from_json(cls, text: str) -> Policy:
        """TANDEM_POLICY's value; raises PolicyError naming what is wrong."""
        try:
            doc = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError as e:
            raise PolicyError(f"{POLICY_ENV} is not JSON: {e}") from None
        _object(doc, "policy", ("default", "namespaces"))
        default = _rules(doc.get("default") or {}, Rules(), "default")
        namespaces = doc.get("namespaces") or {}
        _object(namespaces, "namespaces", None)
        for ns in namespaces:
            if not re.fullmatch(NAMESPACE, ns):
                raise PolicyError(f"policy namespaces: {ns!r} is not a namespace name")
        return cls(default, tuple(sorted((ns, _rules(entry, default, f"namespaces.{ns}"))
                                         for ns, entry in namespaces.items())))


def _object(value: Any, where: str, keys: tuple[str, ...] | None) -> None:
    if not isinstance(value, dict):
        raise PolicyError(f"policy {where} must be an object, not {json.dumps(value)}")
    unknown = sorted(set(value) - set(keys)) if keys is not None else []
    if unknown:
        raise PolicyError(f"policy {where}: unknown key {', '.join(unknown)} (known: {', '.join(keys or ())})")


def _rules(entry: Any, base: Rules, where: str) -> Rules:
    """`entry`'s keys over `base`."""
    _object(entry, where, tuple(KEYS))
    changes: dict[str, Any] = {}
    for key, value in entry.items():
        if key in LISTS:
            if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
                raise PolicyError(f"policy {where}.{key} must be a list of non-empty strings")
            if key.endswith("ostPaths"):
                value = [_prefix(v, f"{where}.{key}") for v in value]
            changes[KEYS[key]] = tuple(value)
        elif not isinstance(value, bool):
            raise PolicyError(f"policy {where}.{key} must be true or false, not {json.dumps(value)}")
        else:
            changes[KEYS[key]] = value
    return dataclasses.replace(base, **changes)


def _prefix(path: str, where: str) -> str:
    if not path.startswith("/"):
        raise PolicyError(f"policy {where}: {path!r} must be an absolute path")
    if _normalised(path) != path:
        raise PolicyError(f"policy {where}: {path!r} must be normalised (as {_normalised(path)!r})")
    return path


def _normalised(path: str) -> str:
    """The path as the node resolves it lexically ('/a/./b/../c/' -> '/a/c'); '//' at the start too."""
    out = posixpath.normpath(path)
    return "/" + out.lstrip("/") if out.startswith("/") else out


def _under(path: str, prefixes: tuple[str, ...]) -> bool:
    """A whole directory below a prefix (or the prefix itself): /mnt/models-x is not under /mnt/models."""
    if _normalised(path) != path:
        return False  # '..' could climb out of any prefix: a CRD older than the operator let it through
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in prefixes)


def repository(reference: str) -> str:
    """registry:5000/org/model:tag@sha256:... -> registry:5000/org/model."""
    repo = reference.split("@", 1)[0]
    head, _, last = repo.rpartition("/")
    return f"{head}/{last.split(':', 1)[0]}" if head else last.split(":", 1)[0]


def _allowed(value: str, allowed: tuple[str, ...]) -> bool:
    return any(a == ANY or a == value or (a.endswith("/") and value.startswith(a)) for a in allowed)


def _how(namespace: str, key: str, change: str) -> str:
    return (f"an admin allows it by {change} in the operator's policy (Helm values policy.namespaces.{namespace}.{key}, "
            f"or policy.default.{key} for every namespace)")


def judge(spec: InferenceServiceSpec, namespace: str, policy: Policy,
          own_images: tuple[str, ...] = ()) -> list[Violation]:
    """Every node-level setting `spec` asks for that `policy` does not allow in `namespace` (nothing:
    allowed). `own_images` are the operator's worker, router and vLLM worker repositories, always allowed."""
    rules = policy.rules(namespace)
    found = _paths(spec, namespace, rules) + _privileges(spec, namespace, rules)
    found += _images(spec, namespace, rules, own_images) + _accounts(spec, namespace, rules)
    return found


def _paths(spec: InferenceServiceSpec, ns: str, rules: Rules) -> list[Violation]:
    model, found = spec.model, []
    readable = rules.host_paths + rules.writable_host_paths
    if model.host_path is not None and not _under(model.host_path, readable):
        found.append(Violation("model.hostPath", (
            f"model.hostPath {model.host_path!r} mounts a node directory the operator's policy does not allow "
            f"in namespace {ns} (allowed: {', '.join(readable) or 'none'}); " + _how(ns, "hostPaths", "adding a prefix to hostPaths"))))
    cache = model.cache.host_path if model.cache is not None else None
    if cache is not None and not _under(cache.path, rules.writable_host_paths):
        found.append(Violation("model.cache.hostPath.path", (
            f"model.cache.hostPath.path {cache.path!r} is a node directory the download writes (and creates), "
            f"which the operator's policy does not allow in namespace {ns} (allowed: "
            f"{', '.join(rules.writable_host_paths) or 'none'}); " + _how(ns, "writableHostPaths", "adding a prefix to writableHostPaths"))))
    return found


def _privileges(spec: InferenceServiceSpec, ns: str, rules: Rules) -> list[Violation]:
    kv, found = spec.kv_transfer, []
    if kv.host_network and not rules.host_network:
        found.append(Violation("kvTransfer.hostNetwork", (
            f"kvTransfer.hostNetwork runs the workers in the node's network namespace, which the operator's "
            f"policy does not allow in namespace {ns}; " + _how(ns, "hostNetwork", "setting hostNetwork: true"))))
    if kv.ipc_lock and not rules.ipc_lock:
        found.append(Violation("kvTransfer.ipcLock", (
            f"kvTransfer.ipcLock runs the workers as root with the IPC_LOCK capability, which the operator's "
            f"policy does not allow in namespace {ns} (most RDMA clusters need it only where the container "
            "runtime limits locked memory: docs/install.md); " + _how(ns, "ipcLock", "setting ipcLock: true"))))
    return found


def _images(spec: InferenceServiceSpec, ns: str, rules: Rules, own: tuple[str, ...]) -> list[Violation]:
    named = [("image", spec.image and spec.image.repository, spec.image and spec.image.pull_policy),
             ("router.image", spec.router.image and spec.router.image.repository,
              spec.router.image and spec.router.image.pull_policy),
             ("runtime.image", spec.runtime.image and spec.runtime.image.repository,
              spec.runtime.image and spec.runtime.image.pull_policy)]
    if spec.model.image is not None:
        image = spec.model.image
        named.append(("model.image", repository(image.reference), image.pull_policy))
    found = []
    for where, repo, pull in named:
        field = "model.image.reference" if where == "model.image" else f"{where}.repository"
        if repo and not _allowed(repo, own + rules.images):
            found.append(Violation(field, (
                f"{field} names the repository {repo!r}, which the operator's policy does not allow in namespace "
                f"{ns} (allowed: {', '.join(own + rules.images) or 'none'}); "
                + _how(ns, "images", "adding the repository (or a prefix ending in '/') to images"))))
        if pull and pull != ALWAYS and rules.always_pull_images:
            found.append(Violation(f"{where}.pullPolicy", (
                f"{where}.pullPolicy {pull} could start a pod from an image already on the node that this "
                f"namespace's pull secrets would not fetch; the operator's policy pulls every image Always in "
                f"namespace {ns}: leave {where}.pullPolicy unset or set Always")))
    return found


def _accounts(spec: InferenceServiceSpec, ns: str, rules: Rules) -> list[Violation]:
    found = []
    for component in (*WORKER_ROLES, "router"):
        part = spec.router if component == "router" else spec.role(component)
        account = part.service_account_name
        if account is not None and not _allowed(account, rules.service_accounts):
            found.append(Violation(f"{component}.serviceAccountName", (
                f"{component}.serviceAccountName runs the {component} pods as ServiceAccount {account!r} "
                f"(with its permissions and cloud identity), which the operator's policy does not allow in "
                f"namespace {ns} (allowed: {', '.join(rules.service_accounts) or 'none named'}); "
                + _how(ns, "serviceAccounts", "adding the name to serviceAccounts"))))
    return found


def refusal(violations: list[Violation]) -> str:
    """Ready's message for a refused spec."""
    return ("refused by the operator's policy, nothing applied: " + "; ".join(v.message for v in violations)
            + " (docs/install.md: What an InferenceService may ask of a node)")
