"""What identifies a rollout: the image reference, the kv_compat label, the config hashes. Pure."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from tandem.contracts.runtimes import Runtime
from tandem.operator.config import OperatorConfig
from tandem.operator.spec import InferenceServiceSpec, to_json


def _ref(repo: str, tag: str) -> str:
    if tag.startswith("@"):
        return repo + tag
    if tag.startswith("sha256:"):
        return f"{repo}@{tag}"
    return f"{repo}:{tag}"


def image_ref(spec: InferenceServiceSpec, config: OperatorConfig) -> tuple[str, str]:
    """The workers' (image, pullPolicy), also their download steps': spec.image's fields (runtime vllm:
    spec.runtime.image's), each falling back to the operator's default for that runtime."""
    if spec.runtime.name is Runtime.VLLM:
        image, repo, tag = spec.runtime.image, config.vllm_repository, config.vllm_tag
    else:
        image, repo, tag = spec.image, config.image_repository, config.image_tag
    repo = (image and image.repository) or repo
    tag = (image and image.tag) or tag
    return _ref(repo, tag), (image and image.pull_policy) or config.pull_policy


def router_image_ref(spec: InferenceServiceSpec, config: OperatorConfig) -> tuple[str, str]:
    """The router's (image, pullPolicy), its own image (no torch): spec.router.image's fields, then the
    operator's router image. A version spec.image pins (a tag, not a digest) pins the router's too, so
    a CR that holds its workers at a release holds its router there as well."""
    own, shared = spec.router.image, spec.image
    repo = (own and own.repository) or config.router_repository
    pinned = shared.tag if shared and shared.tag and "sha256:" not in shared.tag else None
    tag = (own and own.tag) or pinned or config.router_tag
    policy = (own and own.pull_policy) or (shared and shared.pull_policy) or config.pull_policy
    return _ref(repo, tag), policy


def short_hash(obj: Any, length: int = 10) -> str:
    """Stable short hash of a JSON-able value (sorted keys), for labels and annotations."""
    data = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(data).hexdigest()[:length]


def kv_compat_hash(spec: InferenceServiceSpec, config: OperatorConfig) -> str:
    """tandem.dev/kv-compat: what must match for a prefill worker to hand KV to a decode worker.

    A hub model counts by its commit (the operator pins spec.model.revision to it before rendering):
    two kv_compat values of one hub id at different commits never pair. A runtime other than tandem joins
    the hash with its extra args (they may change the KV's layout, e.g. --kv-cache-dtype): a prefill
    and a decode of different runtimes never pair. (Left out for tandem: existing pods keep their label.)"""
    model, kv, runtime = spec.model, spec.kv_transfer, spec.runtime
    engine = {} if runtime.name is Runtime.TANDEM else {
        "runtime": {"name": runtime.name.value, "args": list(runtime.args or ())}}
    return short_hash(
        {
            **engine,
            "source": {"path": model.path, "hostPath": model.host_path, "pvc": to_json(model.pvc),
                       "hub": model.hub, **({"revision": model.revision} if model.hub else {}),
                       **({"image": to_json(model.image)} if model.image else {})},
            "dtype": model.dtype,
            "maxModelLen": model.max_model_len,
            "backend": kv.backend,
            "blockSize": kv.block_size,
            "image": image_ref(spec, config)[0],
        }
    )
