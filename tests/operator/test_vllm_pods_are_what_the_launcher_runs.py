"""A rendered vLLM pod, read by the launcher it runs (`tandem worker --runtime vllm`, worker/vllm/):
its command, args and config file parse with the worker's own flags into exactly the `vllm serve`
that tandem.contracts.vllm_serve renders for the spec; a group's leader and follower, given what
LeaderWorkerSet sets in their pods, become vLLM's multi-node leader and a headless follower. The
router's file is a complete vllm router configuration (tandem.router.config)."""

from __future__ import annotations

import argparse

import pytest
import yaml
from tandem.contracts.vllm_serve import GroupPlace, ServeOptions, serve_args
from tandem.operator.config import OperatorConfig
from tandem.operator.render import render
from tandem.operator.spec.inference_service import EXIT_MARGIN_S
from tandem.router.config import check_complete, load_yaml
from tandem.worker.server import cli
from tandem.worker.vllm import launch

CONFIG = OperatorConfig(vllm_repository="registry.local/tandem-vllm", vllm_tag="1")
SPEC = {"model": {"image": {"reference": "registry.local/models/llama:8b"}, "maxModelLen": 8192,
                  "servedName": "llama-8b", "dtype": "bfloat16"},
        "prefill": {"gpus": 1}, "decode": {"gpus": 4, "parallelism": {"tensor": 8, "nodes": 2}},
        "runtime": {"name": "vllm", "args": ["--enforce-eager", "--kv-cache-dtype", "fp8"]}}
LEADER = "llama-decode-0.llama-decode.serving"


def _launch(container: dict, config_text: str, tmp_path, monkeypatch, env: dict[str, str]) -> list[str]:
    """The `vllm serve` arguments the launcher builds from the pod (a GPU image: no CPU build)."""
    path = tmp_path / "config.yaml"
    path.write_text(config_text)
    argv = [a.replace("/etc/tandem/config.yaml", str(path)) for a in container["command"][2:] + container["args"]]
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(argv)
    for key in ("LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert launch.wants_vllm(args)
    return serve_args(launch.serve_options(cli.resolve_settings(args), args, cpu_build=False))


# On SIGTERM the server drains its streams (--shutdown-timeout) for the pod's grace period (each
# role's default) less the margin it needs to exit before the kubelet kills it.
GRACE_S = {"prefill": 120, "decode": 60}


def _expected(role: str, tensor: int, group: GroupPlace | None, engine: list[str]) -> list[str]:
    return serve_args(ServeOptions(
        model="/model-image/models", served_name="llama-8b", role=role, port=8000, max_model_len=8192,
        tensor=tensor, dtype="bfloat16", group=group, shutdown_timeout_s=GRACE_S[role] - EXIT_MARGIN_S,
        extra=[*engine, "--enforce-eager", "--kv-cache-dtype", "fp8"]))


@pytest.fixture
def rendered(typed, meta):
    out = render(meta, typed(SPEC), CONFIG)
    files = next(m for m in out if m["kind"] == "ConfigMap")["data"]
    return out, files


def test_a_single_node_role_launches_the_contracts_vllm_serve(rendered, tmp_path, monkeypatch):
    out, files = rendered
    pod = next(m for m in out if m["kind"] == "Deployment" and m["metadata"]["name"] == "llama-prefill")
    container = pod["spec"]["template"]["spec"]["containers"][0]
    assert _launch(container, files["prefill.yaml"], tmp_path, monkeypatch, {}) == _expected(
        "prefill", 1, None, ["--max-num-seqs", "64", "--max-num-batched-tokens", "8192"])
    assert pod["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == GRACE_S["prefill"] > EXIT_MARGIN_S


def test_a_groups_leader_and_follower_launch_vllms_multi_node_roles(rendered, tmp_path, monkeypatch):
    out, files = rendered
    lws = next(m for m in out if m["kind"] == "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    engine = ["--max-num-seqs", "64", "--max-num-batched-tokens", "8192"]
    for template, index in (("leaderTemplate", 0), ("workerTemplate", 1)):
        container = lws[template]["spec"]["containers"][0]
        env = {"LWS_LEADER_ADDRESS": LEADER, "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": str(index)}
        assert lws[template]["spec"]["terminationGracePeriodSeconds"] == GRACE_S["decode"]
        got = _launch(container, files["decode.yaml"], tmp_path, monkeypatch, env)
        assert got == _expected("decode", 8, GroupPlace(2, index, LEADER), engine)
        assert ("--headless" in got) == (index == 1)
    assert yaml.safe_load(files["decode.yaml"])["tensor_parallel"] == 8


def test_the_router_file_is_a_complete_vllm_router_configuration(rendered, tmp_path):
    _, files = rendered
    model = tmp_path / "model-image" / "models"  # where the router pod mounts the model image
    model.mkdir(parents=True)
    (model / "tokenizer.json").write_text("{}")
    path = tmp_path / "router.yaml"
    path.write_text(files["router.yaml"].replace("/model-image/models", str(model)))
    config = load_yaml(path)
    check_complete(config)
    assert (config.runtime, config.tokenizer, config.parity_probe) == ("vllm", str(model), True)
