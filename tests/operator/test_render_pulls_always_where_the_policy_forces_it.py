"""Where the operator's policy forces `alwaysPullImages`, every image an InferenceService renders is
pulled Always (the workers, their download steps, the router, a model image volume), so a pod never
starts from an image another tenant's credentials put on the node; elsewhere nothing changes. And a
node path the spec names is refused unless absolute and normalised (the CRD's rule, in the parser too)."""

from __future__ import annotations

import json

import pytest
from tandem.operator.config import OperatorConfig
from tandem.operator.policy import Policy
from tandem.operator.render import render
from tandem.operator.spec import InferenceServiceSpec, SpecError

POLICY = Policy.from_json(json.dumps({"namespaces": {"serving": {"alwaysPullImages": True}}}))
CONFIG = OperatorConfig(pull_policy="IfNotPresent", policy=POLICY)
CAR = "registry.example.com/models/llama@sha256:" + "b" * 64


def _images(manifests: list[dict]) -> dict[str, str]:
    """container name (or `model-volume`) -> its pull policy, over every pod template rendered."""
    out: dict[str, str] = {}
    for m in manifests:
        pod = (m.get("spec") or {}).get("template", {}).get("spec")
        if not pod:
            continue
        for c in pod.get("initContainers", []) + pod["containers"]:
            out[f"{m['metadata']['name']}/{c['name']}"] = c["imagePullPolicy"]
        for v in pod.get("volumes", []):
            if "image" in v:
                out[f"{m['metadata']['name']}/model-volume"] = v["image"].get("pullPolicy", "(unset)")
    return out


@pytest.mark.parametrize("model", [
    {"hub": "org/m", "revision": "a" * 40, "cache": {"pvc": {"size": "10Gi"}}},
    {"hub": "org/m", "revision": "a" * 40},
    {"image": {"reference": CAR}},
])
def test_every_image_is_pulled_always_in_a_namespace_whose_policy_forces_it(typed, meta, model):
    spec = typed({"model": model})
    forced = _images(render(meta, spec, CONFIG.for_namespace(meta["namespace"])))
    assert forced and set(forced.values()) == {"Always"}, forced
    plain = _images(render(meta, spec, CONFIG.for_namespace("elsewhere")))
    assert plain.keys() == forced.keys()
    assert "Always" not in plain.values(), plain


@pytest.mark.parametrize("path", ["/mnt/models/../../etc", "/mnt/./models", "/mnt//models", "/mnt/models/",
                                  "/mnt/..", "/."])
def test_a_node_path_must_be_absolute_and_normalised(typed, defaulted, path):
    for model in ({"hostPath": path}, {"hub": "org/m", "cache": {"hostPath": {"path": path}}}):
        with pytest.raises(SpecError, match="normalised"):
            InferenceServiceSpec.from_dict(defaulted({"model": model}))
    assert typed({"model": {"hostPath": "/"}}).model.host_path == "/", "the root itself is the policy's to refuse"
