"""spec.runtime vllm, rendered (pure, no cluster): prefill and decode run the vLLM worker image's
launcher (`tandem worker --runtime vllm`) with the worker's settings in the config file and the extra
`vllm serve` flags as args; vLLM's ports, probes and environment beside the UCX settings and security
every worker gets; headless followers in a group spanning nodes; a router that reads the model's
tokenizer from the weights' own volume; a kv_compat of its own; what the operator's policy, model
check and KV probe say for it."""

from __future__ import annotations

import pytest
import yaml
from tandem.contracts.model_support import check_model_config
from tandem.contracts.names import RENDEZVOUS_PORT
from tandem.contracts.vllm_serve import MASTER_PORT, NIXL_SIDE_CHANNEL_PORT
from tandem.operator.config import OperatorConfig
from tandem.operator.model_check import checked_at, judge
from tandem.operator.policy import Policy
from tandem.operator.policy import judge as judge_policy
from tandem.operator.render import kv_compat_hash, render
from tandem.operator.spec import InferenceServiceSpec, SpecError
from tandem.operator.spec.inference_service import EXIT_MARGIN_S
from tandem.operator.status import kv_condition

CONFIG = OperatorConfig(image_repository="registry.local/tandem", image_tag="1.2.3",
                        vllm_repository="registry.local/tandem-vllm", vllm_tag="1.2.3-vllm")
MODEL_IMAGE = "registry.local/models/llama:8b"
DEEPSEEK = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "num_attention_heads": 128,
            "num_key_value_heads": 128, "kv_lora_rank": 512}


def vllm_spec(**overrides) -> dict:
    role = {"gpus": 1, "nodeSelector": {"tandem.dev/pool": "gpu"}}
    return {"model": {"image": {"reference": MODEL_IMAGE}, "maxModelLen": 8192, "servedName": "llama-8b"},
            "prefill": dict(role), "decode": {**role, "engine": {"maxNumSeqs": 128, "prefixCaching": False}},
            "runtime": {"name": "vllm", "args": ["--enforce-eager", "--kv-cache-dtype", "fp8"]},
            "kvTransfer": {"ucx": {"transports": "rc,cuda_copy", "netDevices": "mlx5_0:1"},
                           "rdma": {"resourceName": "rdma/ib", "count": 1}}, **overrides}


def _by(manifests: list[dict], kind: str, name: str) -> dict:
    return next(m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name)


def _pod(manifests: list[dict], role: str) -> dict:
    return _by(manifests, "Deployment", f"llama-{role}")["spec"]["template"]["spec"]


def _container(manifests: list[dict], role: str) -> dict:
    return _pod(manifests, role)["containers"][0]


def _env(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_each_role_runs_the_launcher_with_its_settings_and_vllms_extra_flags(typed, meta):
    out = render(meta, typed(vllm_spec()), CONFIG)
    files = _by(out, "ConfigMap", "llama-config")["data"]
    for role, engine in (("prefill", ["--max-num-seqs", "64"]), ("decode", ["--max-num-seqs", "128"])):
        c = _container(out, role)
        assert c["image"] == "registry.local/tandem-vllm:1.2.3-vllm", "the operator's vLLM image"
        assert c["command"] == ["tandem", "worker", "--runtime", "vllm", "--role", role,
                                "--config", "/etc/tandem/config.yaml"]
        extra = [a.removeprefix("--vllm-arg=") for a in c["args"]]
        assert all(a.startswith("--vllm-arg=") for a in c["args"])
        assert extra[:2] == engine and extra[-3:] == ["--enforce-eager", "--kv-cache-dtype", "fp8"], \
            "the engine's limits, then spec.runtime.args last (vLLM takes the last of a repeated flag)"
        assert ("--no-enable-prefix-caching" in extra) == (role == "decode")
        assert yaml.safe_load(files[f"{role}.yaml"]) == {
            "role": role, "model": "/model-image/models", "served_name": "llama-8b", "dtype": "auto",
            "max_model_len": 8192, "host": "0.0.0.0", "port": 8000, "kv_port": NIXL_SIDE_CHANNEL_PORT,
            "log_format": "json", "drain_s": _pod(out, role)["terminationGracePeriodSeconds"] - EXIT_MARGIN_S}
        assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 8000, "nixl": 5600, "kv-events": 5557}
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, "vLLM's /v1/* wants the API key"
        assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] == 3600
        env = _env(c)
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
        assert env["VLLM_API_KEY"] == env["TANDEM_INTERNAL_SECRET"] == \
            {"secretKeyRef": {"name": "llama-internal", "key": "secret"}}
        assert env["UCX_TLS"] == "rc,cuda_copy" and env["UCX_NET_DEVICES"] == "mlx5_0:1"
        assert c["resources"]["limits"] == {"nvidia.com/gpu": "1", "rdma/ib": "1"}
        assert c["securityContext"]["runAsNonRoot"] is True and c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert {"name": "model", "mountPath": "/model-image", "readOnly": True} in c["volumeMounts"]


def test_runtime_image_and_the_users_env_win(typed, meta):
    spec = vllm_spec(runtime={"name": "vllm", "image": {"repository": "registry.local/own-vllm", "tag": "9"}})
    spec["decode"]["env"] = [{"name": "UCX_TLS", "value": "tcp"}, {"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}]
    out = render(meta, typed(spec), CONFIG)
    decode = _container(out, "decode")
    assert decode["image"] == "registry.local/own-vllm:9"
    assert decode["args"][-1] == "--vllm-arg=--no-enable-prefix-caching", "no runtime.args: the engine's limits only"
    assert _env(decode)["UCX_TLS"] == "tcp" and _env(decode)["VLLM_LOGGING_LEVEL"] == "DEBUG"
    assert [e["name"] for e in decode["env"]][-2:] == ["UCX_TLS", "VLLM_LOGGING_LEVEL"], "the user's env last"
    assert len({e["name"] for e in decode["env"]}) == len(decode["env"])


def test_a_group_spanning_nodes_has_a_serving_leader_and_headless_followers(typed, meta):
    spec = vllm_spec()
    spec["decode"] |= {"gpus": 4, "parallelism": {"tensor": 8, "nodes": 2}}
    out = render(meta, typed(spec), CONFIG)
    assert not [m for m in out if m["kind"] == "Deployment" and m["metadata"]["name"] == "llama-decode"]
    group = _by(out, "LeaderWorkerSet", "llama-decode")["spec"]["leaderWorkerTemplate"]
    leader, follower = (group[t]["spec"]["containers"][0] for t in ("leaderTemplate", "workerTemplate"))
    assert yaml.safe_load(_by(out, "ConfigMap", "llama-config")["data"]["decode.yaml"])["tensor_parallel"] == 8
    assert leader["command"] == follower["command"] and leader["args"] == follower["args"], \
        "the launcher finds its node's rank and the leader from LWS_*"
    assert MASTER_PORT == RENDEZVOUS_PORT
    assert {p["name"]: p["containerPort"] for p in leader["ports"]} == {
        "http": 8000, "nixl": 5600, "kv-events": 5557, "dist": MASTER_PORT}
    assert "http" not in {p["name"] for p in follower["ports"]}, "headless: nothing routes to or scrapes it"
    assert not {"startupProbe", "livenessProbe", "readinessProbe"} & set(follower)
    assert leader["readinessProbe"]["httpGet"]["path"] == "/health"
    assert leader["resources"]["limits"]["nvidia.com/gpu"] == "4"


@pytest.mark.parametrize("model, folder, volume", [
    ({"image": {"reference": MODEL_IMAGE}}, "/model-image/models", {"name": "model", "image": {"reference": MODEL_IMAGE}}),
    ({"pvc": {"claimName": "models", "subPath": "llama"}}, "/models",
     {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}}),
    ({"hub": "org/llama", "revision": "c" * 40, "cache": {"pvc": {"size": "100Gi"}}}, f"/weights/org/llama/{'c' * 40}",
     {"name": "weights", "persistentVolumeClaim": {"claimName": "llama-weights", "readOnly": True}}),
])
def test_the_router_speaks_vllm_and_reads_the_tokenizer_from_the_weights_volume(typed, meta, model, folder, volume):
    out = render(meta, typed(vllm_spec(model=model)), CONFIG)
    config = yaml.safe_load(_by(out, "ConfigMap", "llama-config")["data"]["router.yaml"])
    assert (config["runtime"], config["tokenizer"], config.get("parity_probe", True)) == ("vllm", folder, True)
    pod = _by(out, "Deployment", "llama-router")["spec"]["template"]["spec"]
    assert volume in pod["volumes"]
    mounts = pod["containers"][0]["volumeMounts"]
    assert all(m.get("readOnly") for m in mounts if m["name"] == volume["name"])
    assert any(folder.startswith(m["mountPath"]) for m in mounts if m["name"] == volume["name"])
    waits = pod.get("initContainers", [])
    if "hub" in model:  # the router waits for the download Job like the workers, in its own image
        assert [w["command"] for w in waits] == [["tandem", "model", "wait", "--dir", folder]]
        assert waits[0]["image"] == pod["containers"][0]["image"]
    else:
        assert waits == []
    assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    policy = _by(out, "NetworkPolicy", "llama-workers")["spec"]["ingress"]
    from_router = next(r for r in policy if r["from"][0]["podSelector"]["matchLabels"].get("tandem.dev/role") == "router")
    assert {"protocol": "TCP", "port": "kv-events"} in from_router["ports"], "the router reads vLLM's KV events"


def test_tandems_router_and_pods_are_unchanged_by_the_runtime_field(typed, meta):
    plain = {"model": {"path": "/m"}}
    explicit = render(meta, typed({**plain, "runtime": {"name": "tandem"}}), CONFIG)
    assert explicit == render(meta, typed(plain), CONFIG)
    router = yaml.safe_load(_by(explicit, "ConfigMap", "llama-config")["data"]["router.yaml"])
    assert "runtime" not in router and "tokenizer" not in router
    policy = _by(explicit, "NetworkPolicy", "llama-workers")["spec"]["ingress"]
    assert all({"protocol": "TCP", "port": "kv-events"} not in r.get("ports", []) for r in policy)


def test_the_runtime_and_its_args_join_the_kv_compat(typed):
    base = vllm_spec()
    gen = kv_compat_hash(typed(base), CONFIG)
    other_args = kv_compat_hash(typed(vllm_spec(runtime={"name": "vllm", "args": ["--enforce-eager"]})), CONFIG)
    assert gen != other_args, "--kv-cache-dtype changes the KV layout: no pairing across it"
    assert kv_compat_hash(typed({**base, "decode": {"gpus": 2}}), CONFIG) == gen, "a role's own settings do not"


def test_args_that_set_what_tandem_sets_are_refused_by_the_parser_too():
    for args, words in [(["--port", "9000"], "runtime.args may not set --port: Tandem names the ports"),
                        (["--tensor-parallel-size=2"], "may not set --tensor-parallel-size or -tp: tensor parallelism is"),
                        (["-tp", "2", "--enforce-eager"], "may not set --tensor-parallel-size or -tp: tensor parallelism"),
                        (["--enforce-eager", "--foo=1", "org/model"], "'org/model': a positional argument")]:
        with pytest.raises(SpecError, match="spec.runtime") as err:
            InferenceServiceSpec.from_dict({"model": {"path": "/m"}, "runtime": {"name": "vllm", "args": args}})
        assert words in str(err.value)
    with pytest.raises(SpecError, match="runtime.args are vllm serve flags: they apply to runtime vllm only"):
        InferenceServiceSpec.from_dict({"model": {"path": "/m"}, "runtime": {"args": ["--enforce-eager"]}})
    ok = InferenceServiceSpec.from_dict({"model": {"path": "/m"}, "runtime": {"name": "vllm", "args": [
        "--gpu-memory-utilization", "0.85", "--override-kv_compat-config={\"temperature\":0}"]}})
    assert len(ok.runtime.args) == 3


def test_the_policy_judges_runtime_image_and_allows_the_operators_vllm_image(typed):
    models = Policy.from_json('{"default": {"images": ["registry.local/models/"]}}')
    own = typed(vllm_spec(runtime={"name": "vllm", "image": {"repository": "registry.local/tandem-vllm"}}))
    assert judge_policy(own, "serving", models, CONFIG.own_images) == []
    foreign = typed(vllm_spec(runtime={"name": "vllm", "image": {"repository": "docker.io/vllm/vllm-openai"}}))
    (violation,) = judge_policy(foreign, "serving", models, CONFIG.own_images)
    assert violation.field == "runtime.image.repository" and "docker.io/vllm/vllm-openai" in violation.message


def test_the_model_check_asks_what_vllm_serves(typed):
    """An MLA model Tandem's engine refuses is vLLM's to serve; vLLM's own refusals stay refusals."""
    tandem = typed({"model": {"path": "/m"}})
    vllm = typed(vllm_spec())
    assert "multi-head latent attention" in check_model_config(DEEPSEEK)
    assert judge(DEEPSEEK, tandem)[0] == "UnsupportedModel"
    assert judge(DEEPSEEK, vllm) is None
    assert checked_at(vllm) == {"prefill": 1, "decode": 1, "runtime": "vllm"}, "a change of runtime judges again"
    assert checked_at(tandem) == {"prefill": 1, "decode": 1}
    reason, message = judge({"architectures": ["MPTForCausalLM"], "model_type": "mpt"}, vllm)
    assert reason == "UnsupportedModel" and "vLLM dropped it after 0.28.0" in message
    wide = typed({**vllm_spec(), "decode": {"gpus": 3, "parallelism": {"tensor": 3}}})
    reason, message = judge(DEEPSEEK, wide)
    assert reason == "ParallelismMismatch" and message.startswith("decode.parallelism: tensor_parallel 3")
    assert judge({"model_type": "llama"}, vllm)[1] == "config.json names no architectures: vLLM chooses its " \
        "model class by them"


def test_kv_transfer_ready_is_not_applicable_to_vllm_servers(typed):
    condition = kv_condition(typed(vllm_spec()), None)
    assert (condition["status"], condition["reason"]) == ("Unknown", "NotApplicable")
    assert "vLLM's NixlConnector" in condition["message"]
    assert kv_condition(typed({"model": {"path": "/m"}}), None)["reason"] == "NotProbed"


def test_the_vllm_example_renders_and_needs_no_more_than_the_default_policy(typed, meta, examples):
    example = examples["vllm-gpu"]
    spec = typed(example["spec"])
    assert judge_policy(spec, "serving", Policy(), CONFIG.own_images) == []
    out = render({**meta, "name": example["metadata"]["name"]}, spec, CONFIG)
    decode = _by(out, "Deployment", "llama-8b-vllm-decode")["spec"]["template"]["spec"]["containers"][0]
    assert decode["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert decode["args"][-3:] == ["--vllm-arg=--gpu-memory-utilization", "--vllm-arg=0.90",
                                   "--vllm-arg=--enable-chunked-prefill"]
    router = yaml.safe_load(_by(out, "ConfigMap", "llama-8b-vllm-config")["data"]["router.yaml"])
    assert (router["runtime"], router["tokenizer"], router["policy"]) == ("vllm", "/models", "prefix-aware")
