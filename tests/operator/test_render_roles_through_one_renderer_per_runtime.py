"""The runtime seam in the operator (issue 32 item 5): a worker role's config file, container and
group members come from the role renderer of the runtime `render` is given (default `tandem`),
chosen by name and imported only when chosen; an unknown runtime is refused naming the known ones.
The `tandem` renderer's output is what the other render tests pin."""

from __future__ import annotations

import sys
import types

import pytest
import yaml
from tandem.contracts.names import LABEL_GROUP_MEMBER, GroupMember
from tandem.contracts.runtimes import Runtime
from tandem.operator.config import OperatorConfig
from tandem.operator.render import render
from tandem.operator.render.runtimes import registry
from tandem.operator.render.runtimes.registry import RENDERERS
from tandem.operator.render.runtimes.tandem import TandemRoleRenderer

CONFIG = OperatorConfig(image_repository="registry.local/tandem", image_tag="1.2.3")
GROUP = {"model": {"path": "/m"}, "decode": {"gpus": 4, "parallelism": {"tensor": 8, "nodes": 2}}}


class OtherRenderer(TandemRoleRenderer):
    """A runtime of its own: another command, another config file, followers started another way."""

    def config_file(self, name, role, spec):
        return {"other": role}

    def container(self, name, spec, role, config, kv_compat, model_mounts):
        return super().container(name, spec, role, config, kv_compat, model_mounts) | {"command": ["other", role]}

    def group_member(self, pod, member, parallelism):
        if member is GroupMember.FOLLOWER:
            pod["containers"][0]["command"] = [*pod["containers"][0]["command"], "--headless"]
        return pod


@pytest.fixture
def other_runtime(monkeypatch):
    module = types.ModuleType("tandem_test_other_runtime")
    module.OtherRenderer = OtherRenderer
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(registry.RENDERERS, "other", f"{module.__name__}:OtherRenderer")
    return "other"


def _by(manifests, kind, name):
    return next(m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name)


def test_tandem_is_the_default_runtime(typed, meta):
    spec = typed(GROUP)
    assert render(meta, spec, CONFIG, runtime="tandem") == render(meta, spec, CONFIG)


def test_an_unknown_runtime_is_refused_naming_the_known_ones(typed, meta):
    with pytest.raises(ValueError, match=r"unknown runtime 'sglang'; known: \['tandem', 'vllm'\]"):
        render(meta, typed(GROUP), CONFIG, runtime="sglang")


def test_every_runtime_the_spec_can_name_has_a_renderer(typed, meta):
    """spec.runtime.name's enum and the registry are one list; the spec's name picks the renderer."""
    assert sorted(RENDERERS) == sorted(r.value for r in Runtime)
    assert sorted(typed({"model": {"path": "/m"}}).to_dict()["runtime"]) == ["name"]
    for runtime in Runtime:
        renderer = registry.role_renderer(runtime)
        assert all(callable(getattr(renderer, m)) for m in ("config_file", "container", "group_member"))
    spec = typed({**GROUP, "model": {"image": {"reference": "registry.local/models/llama:1"}},
                  "runtime": {"name": "vllm"}})
    out = render(meta, spec, CONFIG)
    assert out == render(meta, spec, CONFIG, runtime="vllm")
    prefill = _by(out, "Deployment", "llama-prefill")["spec"]["template"]["spec"]["containers"][0]
    assert prefill["command"][:4] == ["tandem", "worker", "--runtime", "vllm"]
    assert "kv_backend" not in yaml.safe_load(_by(out, "ConfigMap", "llama-config")["data"]["decode.yaml"]), \
        "the vLLM launcher's settings, not Tandem's engine's"
    group = _by(out, "LeaderWorkerSet", "llama-decode")["spec"]["leaderWorkerTemplate"]
    leader, follower = (group[t]["spec"]["containers"][0] for t in ("leaderTemplate", "workerTemplate"))
    assert "readinessProbe" in leader and "readinessProbe" not in follower, "a vLLM follower is headless"
    # what is every runtime's stays: the same placement, security and pod settings as tandem's
    tandem = _by(render(meta, spec, CONFIG, runtime="tandem"), "Deployment", "llama-prefill")
    vllm_pod = _by(out, "Deployment", "llama-prefill")["spec"]["template"]["spec"]
    assert {k: v for k, v in vllm_pod.items() if k != "containers"} == \
        {k: v for k, v in tandem["spec"]["template"]["spec"].items() if k != "containers"}


def test_a_runtime_is_imported_only_when_chosen(monkeypatch, typed, meta):
    missing = "tandem_test_renderer_that_is_not_installed"
    monkeypatch.setitem(registry.RENDERERS, "absent", f"{missing}:Renderer")
    render(meta, typed(GROUP), CONFIG)
    assert missing not in sys.modules
    with pytest.raises(ModuleNotFoundError):
        registry.role_renderer("absent")


def test_every_runtime_part_of_a_role_comes_from_its_renderer(other_runtime, typed, meta):
    out = render(meta, typed(GROUP), CONFIG, runtime=other_runtime)
    files = _by(out, "ConfigMap", "llama-config")["data"]
    assert yaml.safe_load(files["prefill.yaml"]) == {"other": "prefill"}
    assert "other" not in yaml.safe_load(files["router.yaml"]), "the router's file is no role's"
    prefill = _by(out, "Deployment", "llama-prefill")["spec"]["template"]["spec"]["containers"][0]
    assert prefill["command"] == ["other", "prefill"]
    group = _by(out, "LeaderWorkerSet", "llama-decode")["spec"]["leaderWorkerTemplate"]
    leader, follower = group["leaderTemplate"], group["workerTemplate"]
    assert leader["metadata"]["labels"][LABEL_GROUP_MEMBER] == GroupMember.LEADER
    assert leader["spec"]["containers"][0]["command"] == ["other", "decode"]
    assert follower["spec"]["containers"][0]["command"] == ["other", "decode", "--headless"]
    # what is every runtime's stays: the same volumes, placement and security as tandem's
    tandem = _by(render(meta, typed(GROUP), CONFIG), "Deployment", "llama-prefill")["spec"]["template"]["spec"]
    other_pod = _by(out, "Deployment", "llama-prefill")["spec"]["template"]["spec"]
    assert {k: v for k, v in other_pod.items() if k != "containers"} == \
        {k: v for k, v in tandem.items() if k != "containers"}
