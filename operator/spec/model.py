"""Where the weights come from and how they are loaded: `spec.model`. Pure declarations.

Exactly one source: a path inside the worker image, a node's hostPath, a PersistentVolumeClaim,
an OCI image mounted as a volume (KServe's modelcars), or a Hugging Face hub id. A hub model is
pinned: its `revision` is resolved to a commit when the InferenceService is applied, and the
workers read that commit's files from a cache one download fills (`cache`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tandem.operator.spec.fields import Quantity, Rule, api_field

DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
IMAGE_REF = (r"^[a-z0-9]+([._-][a-z0-9]+)*(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)*"
             r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[a-f0-9]{64})?$")
# A hub model without model.cache downloads into each pod's own emptyDir, never an unbounded one.
DEFAULT_HUB_CACHE_LIMIT = "200Gi"
# Spec types are values: immutable, and built by keyword (parse does it from JSON).
api_type = dataclass(frozen=True, kw_only=True)


def _normalised(path: str) -> bool:
    return path == "/" or not (path.endswith(("/", "/.", "/..")) or any(
        part in path for part in ("//", "/./", "/../")))


def node_path_rule(field: str) -> Rule:
    """A node directory must be absolute and normalised: the operator's policy allows node paths by
    prefix, and '..' would climb out of any prefix (the parser enforces it too)."""
    return Rule(
        "self == '/' || !(self.endsWith('/') || self.endsWith('/.') || self.endsWith('/..') || "
        "self.contains('//') || self.contains('/./') || self.contains('/../'))",
        f"{field} must be an absolute, normalised path: no '.' or '..' segments, no '//' and no trailing '/' "
        "(e.g. /mnt/models/llama)", check=_normalised)


@api_type
class PVCSource:
    """A PersistentVolumeClaim holding the weights, mounted read-only."""

    claim_name: str = api_field("claimName", max_length=253, pattern=DNS_SUBDOMAIN)
    sub_path: str | None = api_field("subPath", max_length=1024)

    RULES: ClassVar[tuple[Rule, ...]] = (Rule(
        "!has(self.subPath) || (!self.subPath.startsWith('/') && !self.subPath.contains('..'))",
        "model.pvc.subPath must be a relative path inside the volume (no leading '/' and no '..')"),)


@api_type
class HubTokenRef:
    """The Secret key holding a hub token (gated or private models); read by the operator and the
    download steps, never written into the spec, a ConfigMap or a log."""

    name: str = api_field("name", max_length=253, pattern=DNS_SUBDOMAIN)
    key: str = api_field("key", max_length=253, pattern="^[-._a-zA-Z0-9]+$", default="token")


@api_type
class WeightsClaim:
    """model.cache.pvc: a PersistentVolumeClaim the operator creates (`<name>-weights`)."""

    size: Quantity = api_field("size", description="Storage requested, e.g. 200Gi: every commit served at once.")
    storage_class_name: str | None = api_field(
        "storageClassName", max_length=253, pattern=DNS_SUBDOMAIN,
        description="A class whose volumes mount on many nodes at once (NFS, CephFS, a cloud file store).")
    access_mode: str = api_field(
        "accessMode", enum=["ReadWriteMany", "ReadOnlyMany", "ReadWriteOnce", "ReadWriteOncePod"],
        default="ReadWriteMany", description="Only ReadWriteMany works: the Job writes, workers on every node read.")

    RULES: ClassVar[tuple[Rule, ...]] = (Rule(
        "self.accessMode == 'ReadWriteMany'",
        "model.cache.pvc.accessMode must be ReadWriteMany: the download Job writes the claim while workers on "
        "several nodes read it. ReadWriteOnce and ReadWriteOncePod mount on one node (one pod) only, and a "
        "ReadOnlyMany claim cannot be filled by the Job; for storage local to each node use "
        "model.cache.hostPath"),)


@api_type
class HostPathCache:
    """model.cache.hostPath: a directory on each node; the first pod on a node downloads, the rest wait."""

    path: str = api_field("path", max_length=1024, pattern="^/", rules=(node_path_rule("model.cache.hostPath.path"),),
                          description="The node directory (created if absent; writable by uid 10001). The "
                          "operator's policy must allow it (writableHostPaths).")


@api_type
class EmptyDirCache:
    """model.cache.emptyDir: each pod downloads into its own emptyDir, bounded."""

    size_limit: Quantity = api_field("sizeLimit", description="The emptyDir's sizeLimit, e.g. 40Gi.")


@api_type
class HubCache:
    """Where a hub model's files land (exactly one)."""

    pvc: WeightsClaim | None = api_field(
        "pvc", description="One shared claim: a download Job fills it once per commit, every worker mounts it "
        "read-only (N replicas, one download).")
    host_path: HostPathCache | None = api_field(
        "hostPath", description="A node-local cache: one download per node (the operator's policy must allow "
        "the path, and it needs the privileged Pod Security level, as any hostPath).")
    empty_dir: EmptyDirCache | None = api_field(
        "emptyDir", description="Per pod: every pod downloads for itself, into a bounded emptyDir.")

    RULES: ClassVar[tuple[Rule, ...]] = (Rule(
        "[has(self.pvc), has(self.hostPath), has(self.emptyDir)].filter(x, x).size() == 1",
        "model.cache: set exactly one of pvc, hostPath or emptyDir"),)


@api_type
class ImageSource:
    """An OCI image holding the weights, mounted read-only as a volume (Kubernetes image volumes)."""

    reference: str = api_field("reference", max_length=512, pattern=IMAGE_REF,
                               description="The image, best by digest: registry/model@sha256:....")
    pull_policy: str | None = api_field("pullPolicy", enum=["Always", "IfNotPresent", "Never"])
    path: str = api_field("path", max_length=1024, pattern="^/", default="/models",
                          description="The folder inside the image holding config.json (modelcars: /models).")


@api_type
class Model:
    """Where the weights are (exactly one source: the CEL rule below) and how to load them."""

    path: str | None = api_field(
        "path", max_length=1024, pattern="^/", description="A directory inside the worker image.")
    host_path: str | None = api_field(
        "hostPath", max_length=1024, pattern="^/", rules=(node_path_rule("model.hostPath"),),
        description="A directory on the node, mounted read-only (the operator's policy must allow it: hostPaths).")
    pvc: PVCSource | None = api_field(
        "pvc", description="A PersistentVolumeClaim in the same namespace, mounted read-only.")
    hub: str | None = api_field(
        "hub", max_length=256, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$",
        description="A Hugging Face hub model id (org/name), downloaded once per commit into model.cache.")
    revision: str | None = api_field(
        "revision", max_length=256, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$",
        description="The hub branch, tag or commit (default main); resolved to a commit when applied "
        "(status.model.commit) and served until the spec changes.")
    token_secret_ref: HubTokenRef | None = api_field(
        "tokenSecretRef", description="A Secret key with a hub token, for gated or private models.")
    cache: HubCache | None = api_field(
        "cache", description="Where a hub model's files land: a shared PVC (one download), a node-local "
        f"hostPath (one per node) or a bounded emptyDir (one per pod; default, {DEFAULT_HUB_CACHE_LIMIT}).")
    image: ImageSource | None = api_field(
        "image", description="An OCI image holding the weights (a modelcar), mounted as an image volume.")
    dtype: str = api_field(
        "dtype", enum=["auto", "float32", "float16", "bfloat16"], default="auto",
        description="Weight and activation dtype.")
    max_model_len: int = api_field(
        "maxModelLen", minimum=16, maximum=1048576, default=4096,
        description="Longest sequence (prompt + output) in tokens.")
    served_name: str | None = api_field(
        "servedName", max_length=128, pattern="^[A-Za-z0-9][A-Za-z0-9._/:-]*$",
        description="Model name in the OpenAI API (default: the InferenceService name).")

    RULES: ClassVar[tuple[Rule, ...]] = (
        Rule("[has(self.path), has(self.hostPath), has(self.pvc), has(self.hub), has(self.image)]"
             ".filter(x, x).size() == 1",
             "model: set exactly one of model.path, model.hostPath, model.pvc, model.hub or model.image"),
        Rule("has(self.hub) || !(has(self.revision) || has(self.tokenSecretRef) || has(self.cache))",
             "model.revision, model.tokenSecretRef and model.cache apply only to model.hub"),
    )

    @property
    def hub_revision(self) -> str:
        """The revision to resolve (main when unset)."""
        return self.revision or "main"
