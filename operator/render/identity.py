"""What identifies a rollout: the image reference, the generation label, the config hashes. Pure."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from tandem.operator.config import OperatorConfig
from tandem.operator.spec import InferenceServiceSpec, to_json


def image_ref(spec: InferenceServiceSpec, config: OperatorConfig) -> tuple[str, str]:
    """(image, pullPolicy): the CR's image fields, each falling back to the operator's default."""
    image = spec.image
    repo = (image and image.repository) or config.image_repository
    tag = (image and image.tag) or config.image_tag
    if tag.startswith("@"):
        ref = repo + tag
    elif tag.startswith("sha256:"):
        ref = f"{repo}@{tag}"
    else:
        ref = f"{repo}:{tag}"
    return ref, (image and image.pull_policy) or config.pull_policy


def short_hash(obj: Any, length: int = 10) -> str:
    """Stable short hash of a JSON-able value (sorted keys), for labels and annotations."""
    data = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(data).hexdigest()[:length]


def generation_hash(spec: InferenceServiceSpec, config: OperatorConfig) -> str:
    """tandem.dev/generation: what must match for a prefill worker to hand KV to a decode worker.

    A hub model counts by its commit (the operator pins spec.model.revision to it before rendering):
    two generations of one hub id at different commits never pair."""
    model, kv = spec.model, spec.kv_transfer
    return short_hash(
        {
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
