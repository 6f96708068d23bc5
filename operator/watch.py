"""What the operator watches, and what it has seen of one InferenceService.

kopf keeps an index per kind (registered in handlers.py), fed by the same watch streams that start
passes: the InferenceServices by (namespace, name), and every kind the operator applies, and the
pods and ReplicaSets under them, by (namespace, service) through the `tandem.dev/service` label. A
pass reads them instead of listing: an idle pass makes no API call for what it observes, and a
child someone deletes or edits is seen at once, from its event.

Labels select; they prove nothing. Which of the seen objects are the service's is decided by their
owner references (tandem.operator.observe, ownership.py), as it was when the operator listed them.
Secrets are not watched (the operator never reads one): the internal Secret is created if absent.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tandem.contracts.names import LABEL_SERVICE
from tandem.operator.config import FIELD_MANAGER, HANDOVER_MANAGER

Key = tuple[str, str]  # (namespace, InferenceService name)


@dataclass(frozen=True)
class Kind:
    """One watched kind: where it is served, and what its events ask of the operator."""

    group: str
    version: str
    plural: str
    kind: str
    status: bool = False  # its changes refresh the service's status (else only drift matters)
    applied: bool = True  # the operator applies objects of this kind (its events may be drift)
    whole: bool = False  # a pass reads its spec and status too (else only its metadata is kept)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def index(self) -> str:
        """The kopf index's id (the keyword a handler receives it under)."""
        return f"seen_{self.plural}"


LWS = Kind("leaderworkerset.x-k8s.io", "v1", "leaderworkersets", "LeaderWorkerSet", status=True, whole=True)
WATCHED: tuple[Kind, ...] = (
    Kind("apps", "v1", "deployments", "Deployment", status=True, whole=True),
    LWS,
    Kind("", "v1", "pods", "Pod", status=True, applied=False, whole=True),
    Kind("apps", "v1", "replicasets", "ReplicaSet", applied=False),  # the pods' owner chain
    Kind("batch", "v1", "jobs", "Job", status=True, whole=True),
    Kind("", "v1", "services", "Service", status=True),
    Kind("", "v1", "configmaps", "ConfigMap"),
    Kind("", "v1", "serviceaccounts", "ServiceAccount"),
    Kind("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim"),
    Kind("rbac.authorization.k8s.io", "v1", "roles", "Role"),
    Kind("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding"),
    Kind("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy"),
    Kind("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget"),
    # spec.gateway: kinds the user's gateway installs (watched once their CRDs exist)
    Kind("inference.networking.k8s.io", "v1", "inferencepools", "InferencePool"),
    Kind("gateway.networking.k8s.io", "v1", "httproutes", "HTTPRoute"),
)
BY_KIND = {k.kind: k for k in WATCHED}
# managedFields are kept only where a pass reads them: who owns a workload's replicas.
MANAGED = ("Deployment", "LeaderWorkerSet")


def ref(obj: Mapping[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def service_key(body: Mapping[str, Any]) -> Key:
    meta = body["metadata"]
    return meta["namespace"], meta["labels"][LABEL_SERVICE]


def kept(body: Mapping[str, Any], kind: Kind) -> dict[str, Any]:
    """The object as an index keeps it: a plain dict with its kind (a listed item has none of its
    own), and no more than a pass reads, since memory grows with every child of every service: its
    metadata alone, but for pods and Jobs (whole) and workloads (their replicas, group size and
    status, and who of the operator's field managers owns what: not their pod template)."""
    meta = {k: v for k, v in body["metadata"].items() if k != "managedFields"}
    if kind.kind in MANAGED:
        meta["managedFields"] = [f for f in body["metadata"].get("managedFields") or []
                                 if f.get("manager") in (FIELD_MANAGER, HANDOVER_MANAGER)]
    obj: dict[str, Any] = {"apiVersion": kind.api_version, "kind": kind.kind, "metadata": meta}
    if kind.whole:
        obj |= {k: v for k, v in body.items() if k not in ("metadata", "apiVersion", "kind")}
    if kind.kind in MANAGED and isinstance(obj.get("spec"), dict):
        spec = {k: v for k, v in obj["spec"].items() if k not in ("template", "leaderWorkerTemplate")}
        if "leaderWorkerTemplate" in obj["spec"]:
            spec["leaderWorkerTemplate"] = {"size": (obj["spec"]["leaderWorkerTemplate"] or {}).get("size")}
        obj["spec"] = spec
    return obj


@dataclass
class Seen:
    """One service's watched children as the indexes hold them now (plain lists, copied on the event
    loop, so a pass may read them from a thread)."""

    objects: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # kind -> objects

    def of(self, *kinds: str) -> list[dict[str, Any]]:
        return [o for kind in kinds for o in self.objects.get(kind, [])]

    def applied(self) -> dict[str, dict[str, Any]]:
        """Every object of a kind the operator applies, by "Kind/name"."""
        return {ref(o): o for k in WATCHED if k.applied for o in self.objects.get(k.kind, [])}

    def fingerprint(self) -> frozenset[tuple]:
        """What says whether an applied kind's object changed: its resourceVersion, or for one with a
        spec generation (its controller writes its status), that generation and its labels. Equal
        fingerprints: nothing the operator applies was changed."""
        return frozenset((r, *_stamp(o)) for r, o in self.applied().items())

    def overlaid(self, stored: Iterable[dict[str, Any]], gone: Iterable[str] = ()) -> Seen:
        """These objects with `stored` (what an apply just returned) in place of what the watch had,
        and without the refs in `gone` (just deleted)."""
        fresh, gone = {ref(o): o for o in stored}, set(gone)
        objects = {kind: [fresh.pop(ref(o), o) for o in objs if ref(o) not in gone]
                   for kind, objs in self.objects.items()}
        for obj in fresh.values():
            objects.setdefault(obj["kind"], []).append(obj)
        return Seen(objects)


def _stamp(obj: dict[str, Any]) -> tuple:
    meta = obj["metadata"]
    if meta.get("generation") is None:
        return (meta.get("resourceVersion", ""),)
    return (meta["generation"], tuple(sorted((meta.get("labels") or {}).items())))


class Watched:
    """kopf's indexes, read by the work queue's passes: the InferenceService and its children."""

    def __init__(self, services: Mapping[Key, Any], children: Mapping[str, Mapping[Key, Any]]) -> None:
        """`services`: kopf's index of InferenceServices; `children`: Kind.index -> kopf's index."""
        self.services, self.children = services, children

    def service(self, key: Key) -> dict[str, Any] | None:
        """The InferenceService as last seen by the watch, None when it has not been seen (or is gone)."""
        store = self.services.get(key)
        return next(iter(store), None) if store else None

    def seen(self, key: Key) -> Seen:
        objects = {}
        for kind in WATCHED:
            index = self.children.get(kind.index)
            store = index.get(key) if index is not None else None
            if store:
                objects[kind.kind] = list(store)
        return Seen(objects)
