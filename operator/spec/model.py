"""Where the weights come from and how they are loaded: `spec.model`. Pure declarations.

Exactly one source: a path inside the image, a node's hostPath, a PersistentVolumeClaim, or a
Hugging Face hub id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tandem.operator.spec.fields import Rule, api_field

DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# Spec types are values: immutable, and built by keyword (parse does it from JSON).
api_type = dataclass(frozen=True, kw_only=True)


@api_type
class PVCSource:
    """A PersistentVolumeClaim holding the weights, mounted read-only."""

    claim_name: str = api_field("claimName", max_length=253, pattern=DNS_SUBDOMAIN)
    sub_path: str | None = api_field("subPath", max_length=1024)

    RULES: ClassVar[tuple[Rule, ...]] = (Rule(
        "!has(self.subPath) || (!self.subPath.startsWith('/') && !self.subPath.contains('..'))",
        "model.pvc.subPath must be a relative path inside the volume (no leading '/' and no '..')"),)


@api_type
class Model:
    """Where the weights are (exactly one source: the CEL rule below) and how to load them."""

    path: str | None = api_field(
        "path", max_length=1024, pattern="^/", description="A directory inside the worker image.")
    host_path: str | None = api_field(
        "hostPath", max_length=1024, pattern="^/", description="A directory on the node, mounted read-only.")
    pvc: PVCSource | None = api_field(
        "pvc", description="A PersistentVolumeClaim in the same namespace, mounted read-only.")
    hub: str | None = api_field(
        "hub", max_length=256, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$",
        description="A Hugging Face hub model id (org/name); needs internet access from the nodes.")
    dtype: str = api_field(
        "dtype", enum=["auto", "float32", "float16", "bfloat16"], default="auto",
        description="Weight and activation dtype.")
    max_model_len: int = api_field(
        "maxModelLen", minimum=16, maximum=1048576, default=4096,
        description="Longest sequence (prompt + output) in tokens.")
    served_name: str | None = api_field(
        "servedName", max_length=128, pattern="^[A-Za-z0-9][A-Za-z0-9._/:-]*$",
        description="Model name in the OpenAI API (default: the InferenceService name).")

    RULES: ClassVar[tuple[Rule, ...]] = (Rule(
        "[has(self.path), has(self.hostPath), has(self.pvc), has(self.hub)].filter(x, x).size() == 1",
        "model: set exactly one of model.path, model.hostPath, model.pvc or model.hub"),)
