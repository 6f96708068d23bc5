"""An InferenceService with `runtime: vllm` on the real control plane (etcd, kube-apiserver,
controller-manager, scheduler, the LeaderWorkerSet controller, KWOK GPU/RDMA nodes; the operator as
a subprocess with the Helm chart's RBAC): it becomes Ready with prefill and decode run by the vLLM
worker image's launcher, single-node and as a LeaderWorkerSet whose followers are headless; its
router speaks vLLM and reads the tokenizer from the model's own volume; KVTransferReady says the
report does not apply. A DeepSeek-V3 (MLA) model on the hub, which Tandem's engine refuses, passes
the model check with runtime vllm (testing/fake_hub.py serves its config.json). `kubectl apply` refuses runtime args that collide with what Tandem sets,
naming each flag and why, and what runtime vllm cannot honour.
"""

from __future__ import annotations

import json
import os

import pytest
import yaml
from kubernetes import client
from tandem.contracts.vllm_serve import TANDEM_FLAGS
from tandem.testing.cluster import wait_until
from tandem.testing.fake_hub import FakeHub, Repo
from tandem.testing.inference_services import condition as _cond
from tandem.testing.inference_services import read
from tandem.testing.kube_nodes import GPU_TOLERATION, POOL_LABEL

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

VLLM_IMAGE = "registry.test/tandem-worker-vllm:test"
MODEL_IMAGE = "registry.test/models/tiny@sha256:" + "d" * 64


def role(pool: str, **extra) -> dict:
    return {"gpus": 1, "cpu": "100m", "memory": "1Gi", "nodeSelector": {POOL_LABEL: pool},
            "tolerations": [dict(GPU_TOLERATION)], **extra}


def vllm_spec(**overrides) -> dict:
    return {"model": {"image": {"reference": MODEL_IMAGE, "pullPolicy": "IfNotPresent"}, "maxModelLen": 2048},
            "prefill": role("prefill"), "decode": role("decode"),
            "runtime": {"name": "vllm", "args": ["--enforce-eager"]},
            "router": {"cpu": "50m", "memory": "128Mi"}, **overrides}


def body(name: str, spec: dict) -> dict:
    return {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name}, "spec": spec}


DEEPSEEK = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "num_attention_heads": 8,
            "num_key_value_heads": 8, "kv_lora_rank": 64}


@pytest.fixture(scope="module")
def hub():
    with FakeHub({"tiny/deepseek": Repo({"config.json": json.dumps(DEEPSEEK).encode()})}) as server:
        yield server


@pytest.fixture(scope="module")
def operator(start_operator, chart_rbac, hub):
    """One operator for the module, with the chart's RBAC and HF_ENDPOINT at the fake hub; its policy
    allows the test's model images."""
    policy = json.dumps({"default": {"images": ["registry.test/models/"]}})
    old = os.environ.get("HF_ENDPOINT")
    os.environ["HF_ENDPOINT"] = hub.url
    try:
        return start_operator("--policy", policy, "--vllm-image", VLLM_IMAGE, kubeconfig=chart_rbac().kubeconfig)
    finally:
        os.environ.pop("HF_ENDPOINT") if old is None else os.environ.__setitem__("HF_ENDPOINT", old)


def _ready(api, ns: str, name: str, summary: str = "1/1") -> dict:
    def ready() -> dict | None:
        tis = read(api, ns, name)
        st = tis.get("status") or {}
        ok = (_cond(tis, "Ready").get("status") == "True" and st.get("observedGeneration") == tis["metadata"]["generation"]
              and all(st.get(r, {}).get("summary") == summary for r in ("prefill", "decode")))
        return tis if ok else None

    try:
        return wait_until(ready, timeout=120, what=f"{name} Ready with {summary} per role")
    except TimeoutError as e:
        raise AssertionError(f"{e}; status: {json.dumps(read(api, ns, name).get('status'), indent=1)}") from None


def _pods(api, ns: str, name: str, role_: str) -> list:
    sel = f"tandem.dev/service={name},tandem.dev/role={role_}"
    return [p for p in client.CoreV1Api(api).list_namespaced_pod(ns, label_selector=sel).items
            if not p.metadata.deletion_timestamp]


def _apply(k8s, ns: str, manifest: dict, *flags: str, check: bool = True):
    return k8s.kubectl("apply", *flags, "-n", ns, "-f", "-", input=yaml.safe_dump(manifest), check=check)


def test_a_vllm_service_becomes_ready_with_launcher_pods_and_a_vllm_router(k8s, api, operator, namespace):
    name = "vl"
    _apply(k8s, namespace, body(name, vllm_spec()))
    tis = _ready(api, namespace, name)
    kv = _cond(tis, "KVTransferReady")
    assert (kv["status"], kv["reason"]) == ("Unknown", "NotApplicable"), kv
    assert _cond(tis, "ModelReady")["reason"] == "NotChecked"
    for role_, kv_role in (("prefill", "prefill"), ("decode", "decode")):
        (pod,) = _pods(api, namespace, name, role_)
        pod = api.sanitize_for_serialization(pod)
        c = pod["spec"]["containers"][0]
        assert c["image"] == VLLM_IMAGE
        assert c["command"] == ["tandem", "worker", "--runtime", "vllm", "--role", kv_role,
                                "--config", "/etc/tandem/config.yaml"]
        assert c["args"][-1] == "--vllm-arg=--enforce-eager"
        assert {p["name"] for p in c["ports"]} == {"http", "nixl", "kv-events"}
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        env = {e["name"]: e for e in c["env"]}
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"] == {"fieldRef": {"apiVersion": "v1",
                                                                                "fieldPath": "status.podIP"}}
        assert env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": f"{name}-internal", "key": "secret"}
        assert pod["metadata"]["labels"]["tandem.dev/kv-compat"] == tis["status"]["kvCompat"]
    data = client.CoreV1Api(api).read_namespaced_config_map(f"{name}-config", namespace).data
    assert yaml.safe_load(data["decode.yaml"])["model"] == "/model-image/models"
    router_config = yaml.safe_load(data["router.yaml"])
    assert (router_config["runtime"], router_config["tokenizer"], router_config.get("parity_probe", True)) == \
        ("vllm", "/model-image/models", True)
    (router,) = _pods(api, namespace, name, "router")
    mounts = {m.name: m for m in router.spec.containers[0].volume_mounts}
    assert mounts["model"].read_only and mounts["model"].mount_path == "/model-image"


def test_a_vllm_decode_group_spanning_nodes_has_headless_followers(k8s, api, operator, namespace):
    name = "vlgroup"
    spec = vllm_spec(decode=role("decode", gpus=4, parallelism={"tensor": 8, "nodes": 2}))
    _apply(k8s, namespace, body(name, spec))
    _ready(api, namespace, name)
    lws = client.CustomObjectsApi(api).get_namespaced_custom_object(
        "leaderworkerset.x-k8s.io", "v1", namespace, "leaderworkersets", f"{name}-decode")
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    pods = {p.metadata.labels["tandem.dev/group-member"]: p for p in _pods(api, namespace, name, "decode")}
    assert sorted(pods) == ["follower", "leader"]
    leader, follower = (pods[m].spec.containers[0] for m in ("leader", "follower"))
    assert leader.command == follower.command and leader.args == follower.args
    assert {p.name for p in leader.ports} == {"http", "nixl", "kv-events", "dist"}
    assert "http" not in {p.name for p in follower.ports}
    assert follower.readiness_probe is None and follower.startup_probe is None and follower.liveness_probe is None
    assert leader.readiness_probe.http_get.path == "/health"
    env = {e.name: e.value for e in follower.env if e.value is not None}
    assert env["LWS_WORKER_INDEX"] == "1" and env["LWS_LEADER_ADDRESS"] == f"{name}-decode-0.{name}-decode.{namespace}"
    config = yaml.safe_load(client.CoreV1Api(api).read_namespaced_config_map(f"{name}-config", namespace)
                            .data["decode.yaml"])
    assert config["tensor_parallel"] == 8, "the launcher splits it over LWS_GROUP_SIZE nodes"


def test_runtime_args_that_collide_are_refused_at_apply_with_each_flag_and_why(k8s, crd_installed, namespace):
    cases = [
        (["--enforce-eager", "--tensor-parallel-size", "4", "--port=9000"],
         ["runtime.args may not set --tensor-parallel-size or -tp: tensor parallelism is "
          "spec.<role>.parallelism.tensor (Tandem sets it itself)",
          "runtime.args may not set --port: Tandem names the ports (Tandem sets it itself)"]),
        (["--kv-transfer-config", "{}"],
         [f"runtime.args may not set --kv-transfer-config: {TANDEM_FLAGS['--kv-transfer-config']}"]),
        (["meta-llama/Llama-3.1-8B", "--enforce-eager"], ["runtime.args may hold only flags and their values"]),
        (["--dtype=half", "meta-llama/Llama-3.1-8B"], ["runtime.args may hold only flags and their values"]),
    ]
    for args, words in cases:
        proc = _apply(k8s, namespace, body("collide", vllm_spec(runtime={"name": "vllm", "args": args})), check=False)
        assert proc.returncode != 0, args
        for w in words:
            assert w in proc.stderr, (args, proc.stderr)
    refusals = [
        ({**vllm_spec(), "runtime": {"name": "tandem", "args": ["--enforce-eager"]}},
         "runtime.args are vllm serve flags: they apply to runtime vllm only"),
        ({**vllm_spec(), "model": {"path": "/models/tiny"}}, "runtime vllm: the router tokenizes with the model's own files"),
        ({**vllm_spec(), "kvTransfer": {"backend": "tcp"}}, "kvTransfer.backend must be nixl"),
        ({**vllm_spec(), "image": {"tag": "1.0"}}, "with runtime vllm set runtime.image"),
        ({**vllm_spec(), "decode": role("decode", engine={"kvMemoryFraction": 0.5})}, "--gpu-memory-utilization"),
    ]
    for spec, words in refusals:
        proc = _apply(k8s, namespace, body("refused", spec), check=False)
        assert proc.returncode != 0 and words in proc.stderr, (words, proc.stderr)
    ok = _apply(k8s, namespace, body("ok", vllm_spec(runtime={"name": "vllm", "args": [
        "--gpu-memory-utilization", "0.85", "--override-generation-config={\"temperature\": 0}"]})),
        "--dry-run=server", check=False)
    assert ok.returncode == 0, ok.stderr
    # The operator's planner reads vLLM's own metrics (planning/autoscaling/scrape.py): Operator mode is admitted
    planned = _apply(k8s, namespace, body("planned", {**vllm_spec(), "autoscaling": {
        "prefill": {"maxReplicas": 3}, "decode": {"mode": "Operator", "maxReplicas": 4}}}), "--dry-run=server", check=False)
    assert planned.returncode == 0, planned.stderr


def test_an_mla_model_tandem_refuses_passes_the_model_check_on_vllm(k8s, api, operator, namespace):
    model = {"hub": "tiny/deepseek", "cache": {"pvc": {"size": "1Gi"}}}
    _apply(k8s, namespace, body("dsv3", vllm_spec(model=model)))

    def checked() -> dict | None:
        tis = read(api, namespace, "dsv3")
        return tis if (tis.get("status") or {}).get("model", {}).get("served") else None

    try:
        tis = wait_until(checked, timeout=90, what="dsv3's model judged")
    except TimeoutError as e:
        raise AssertionError(f"{e}; status: {json.dumps(read(api, namespace, 'dsv3').get('status'), indent=1)}") from None
    found = tis["status"]["model"]
    assert found["served"] == "vLLM 0.32.0 serves DeepseekV3ForCausalLM natively"
    assert found["checked"] == {"prefill": 1, "decode": 1, "runtime": "vllm"} and "problem" not in found
    assert _cond(tis, "ModelReady")["status"] != "False", _cond(tis, "ModelReady")
    # the same model on Tandem's engine is refused before anything is created
    tandem = vllm_spec(model=model, runtime={"name": "tandem"})
    _apply(k8s, namespace, body("dsv3-tandem", tandem))
    refused = wait_until(lambda: (t := read(api, namespace, "dsv3-tandem")) and
                         _cond(t, "ModelReady").get("status") == "False" and t, timeout=90, what="refused")
    assert "multi-head latent attention" in _cond(refused, "ModelReady")["message"]
