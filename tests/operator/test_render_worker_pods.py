"""The renderer gives prefill/decode pods what a production GPU fleet needs (pure, no cluster)."""

from __future__ import annotations

import yaml
from tandem.operator.config import OperatorConfig
from tandem.operator.render import render

CONFIG = OperatorConfig(image_repository="registry.local/tandem", image_tag="1.2.3", pull_policy="IfNotPresent")


def _by(manifests: list[dict], kind: str, name: str) -> dict:
    return next(m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name)


def _pod(manifests: list[dict], role: str, svc: str = "llama") -> dict:
    return _by(manifests, "Deployment", f"{svc}-{role}")["spec"]["template"]


def _env(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_roce_example_pods_request_gpu_and_rdma_and_lock_memory(examples, typed, meta):
    spec = typed(examples["gpu-roce"]["spec"])
    out = render(meta, spec, CONFIG)
    for role, pool in (("prefill", "prefill"), ("decode", "decode")):
        pod = _pod(out, role)["spec"]
        c = pod["containers"][0]
        for part in ("requests", "limits"):
            assert c["resources"][part]["nvidia.com/gpu"] == "1"
            assert c["resources"][part]["rdma/rdma_shared_device_a"] == "1"
            assert c["resources"][part]["memory"] == "64Gi"
        assert pod["nodeSelector"] == {"tandem.dev/pool": pool}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        assert "hostNetwork" not in pod and "dnsPolicy" not in pod
        env = _env(c)
        assert env["UCX_TLS"] == "rc_x,rc,dc_x,dc,cuda_copy,cuda_ipc"
        assert env["UCX_NET_DEVICES"] == "mlx5_0:1"
        assert env["UCX_IB_ADDR_TYPE"] == "eth"
        assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        # the model PVC is mounted read-only at the sub-path
        model_mount = next(m for m in c["volumeMounts"] if m["name"] == "model")
        assert model_mount == {"name": "model", "mountPath": "/models", "readOnly": True,
                               "subPath": "meta-llama/Llama-3.1-8B-Instruct"}
        vol = next(v for v in pod["volumes"] if v["name"] == "model")
        assert vol["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}


def test_ib_hostnetwork_example_uses_host_network_with_cluster_dns(examples, typed, meta):
    spec = typed(examples["gpu-ib-hostnetwork"]["spec"])
    out = render(meta, spec, CONFIG)
    for role in ("prefill", "decode"):
        pod = _pod(out, role)["spec"]
        assert pod["hostNetwork"] is True
        assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
        c = pod["containers"][0]
        assert c["resources"]["limits"]["rdma/ib"] == "4"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
        vol = next(v for v in pod["volumes"] if v["name"] == "model")
        assert vol["hostPath"] == {"path": "/mnt/models/Llama-3.1-70B-Instruct", "type": "Directory"}
    assert _pod(out, "prefill")["spec"]["terminationGracePeriodSeconds"] == 300


def test_cpu_example_asks_for_no_gpu_rdma_or_capability(examples, typed, meta):
    spec = typed(examples["cpu"]["spec"])
    out = render(meta, spec, CONFIG)
    for role in ("prefill", "decode"):
        pod = _pod(out, role)["spec"]
        c = pod["containers"][0]
        assert set(c["resources"]["limits"]) == {"cpu", "memory"}
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert c["securityContext"]["runAsNonRoot"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert "hostNetwork" not in pod
        env = _env(c)
        assert not any(k.startswith("UCX_") for k in env), "the tcp backend gets no UCX settings"
        assert not any(v["name"] == "model" for v in pod["volumes"]), "an in-image path needs no volume"


def test_worker_pod_probes_shm_grace_and_spread(typed, meta):
    spec = typed({"model": {"hub": "org/model"}})
    out = render(meta, spec, CONFIG)
    for role, grace in (("prefill", 120), ("decode", 60)):
        pod = _pod(out, role)["spec"]
        c = pod["containers"][0]
        assert c["startupProbe"]["httpGet"]["path"] == "/ready"
        assert c["startupProbe"]["periodSeconds"] == 30
        assert c["startupProbe"]["failureThreshold"] == 120  # one hour to load a model
        assert c["livenessProbe"]["httpGet"]["path"] == "/health"
        assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
        shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        assert pod["terminationGracePeriodSeconds"] == grace
        spread = pod["topologySpreadConstraints"][0]
        assert spread["topologyKey"] == "kubernetes.io/hostname"
        assert spread["labelSelector"]["matchLabels"] == {"tandem.dev/service": "llama", "tandem.dev/role": role}
        assert c["command"] == ["tandem", "worker", "--role", role, "--config", "/etc/tandem/config.yaml"]
        assert c["image"] == "registry.local/tandem:1.2.3"
        assert pod["automountServiceAccountToken"] is False
        # a hub model is on disk before the worker starts: the worker itself never downloads
        assert _env(c)["HF_HUB_OFFLINE"] == "1"


def test_labels_owner_reference_and_config_hash(typed, meta):
    spec = typed({"model": {"path": "/m"}})
    out = render(meta, spec, CONFIG)
    for m in out:
        assert m["metadata"]["namespace"] == "serving"
        assert m["metadata"]["ownerReferences"] == [{
            "apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService", "name": "llama",
            "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True,
        }]
        assert m["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "tandem-operator"
        assert m["metadata"]["labels"]["tandem.dev/service"] == "llama"
    gens = set()
    for role in ("prefill", "decode"):
        labels = _pod(out, role)["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "tandem"
        assert labels["app.kubernetes.io/instance"] == "llama"
        assert labels["app.kubernetes.io/component"] == role
        assert labels["tandem.dev/role"] == role
        gens.add(labels["tandem.dev/kv-compat"])
        assert len(_pod(out, role)["metadata"]["annotations"]["tandem.dev/config-hash"]) == 16
    assert len(gens) == 1, "prefill and decode of one spec share a kv_compat"


def test_engine_settings_land_in_the_role_config_file(typed, meta):
    spec = typed({
        "model": {"path": "/m", "dtype": "bfloat16", "maxModelLen": 8192, "servedName": "m"},
        "prefill": {"engine": {"maxBatchedTokens": 16384, "kvBlocks": 4096}},
        "decode": {"engine": {"maxNumSeqs": 128, "kvMemoryFraction": 0.5, "prefixCaching": False,
                              "prefillChunkTokens": 96}},
        "kvTransfer": {"backend": "tcp", "blockSize": 32},
    })
    cm = _by(render(meta, spec, CONFIG), "ConfigMap", "llama-config")
    prefill = yaml.safe_load(cm["data"]["prefill.yaml"])
    decode = yaml.safe_load(cm["data"]["decode.yaml"])
    assert prefill == {
        "role": "prefill", "model": "/m", "served_name": "m", "dtype": "bfloat16",
        "max_model_len": 8192, "host": "0.0.0.0", "port": 8000, "kv_backend": "tcp", "kv_port": 5601,
        "block_size": 32, "max_num_seqs": 64, "max_batched_tokens": 16384, "num_blocks": 4096,
        "prefix_caching": True, "log_format": "json", "drain_s": 115, "kv_lease_s": 30,
    }
    assert decode["max_num_seqs"] == 128 and decode["kv_memory_fraction"] == 0.5
    assert decode["prefix_caching"] is False
    assert decode["prefill_chunk_tokens"] == 96, "tandem plan's chunk size reaches the worker's flag"
    assert "num_blocks" not in decode
    # each role mounts only its own file, as config.yaml
    pod = _pod(render(meta, spec, CONFIG), "decode")["spec"]
    cfg = next(v for v in pod["volumes"] if v["name"] == "config")["configMap"]
    assert cfg == {"name": "llama-config", "items": [{"key": "decode.yaml", "path": "config.yaml"}]}


def test_changing_engine_settings_rolls_only_that_role(typed, meta):
    base = {"model": {"path": "/m"}}
    changed = {"model": {"path": "/m"}, "decode": {"engine": {"maxNumSeqs": 7}}}
    a = render(meta, typed(base), CONFIG)
    b = render(meta, typed(changed), CONFIG)

    def h(out, role):
        return _pod(out, role)["metadata"]["annotations"]["tandem.dev/config-hash"]

    assert h(a, "decode") != h(b, "decode")
    assert h(a, "prefill") == h(b, "prefill")


def test_kv_compat_changes_with_what_makes_prefill_and_decode_compatible(typed, meta):
    def gen(spec, config=CONFIG):
        return _pod(render(meta, typed(spec), config), "prefill")["metadata"]["labels"]["tandem.dev/kv-compat"]

    base = gen({"model": {"path": "/m"}})
    assert gen({"model": {"path": "/m"}, "prefill": {"replicas": 5}}) == base
    assert gen({"model": {"path": "/m"}, "decode": {"engine": {"maxNumSeqs": 3}}}) == base
    assert gen({"model": {"path": "/other"}}) != base
    assert gen({"model": {"path": "/m", "dtype": "float16"}}) != base
    assert gen({"model": {"path": "/m", "maxModelLen": 8192}}) != base
    assert gen({"model": {"path": "/m"}, "kvTransfer": {"backend": "tcp"}}) != base
    assert gen({"model": {"path": "/m"}, "kvTransfer": {"blockSize": 32}}) != base
    assert gen({"model": {"path": "/m"}, "image": {"tag": "9.9"}}) != base


def test_user_env_and_affinity_pass_through(typed, meta):
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}]}}}
    spec = typed({"model": {"path": "/m"}, "kvTransfer": {"ucx": {"transports": "rc,tcp"}}, "prefill": {
        "affinity": affinity, "env": [{"name": "NCCL_DEBUG", "value": "INFO"}, {"name": "UCX_TLS", "value": "tcp"}]}})
    pod = _pod(render(meta, spec, CONFIG), "prefill")["spec"]
    assert pod["affinity"] == affinity
    env = pod["containers"][0]["env"]
    assert env[-1] == {"name": "NCCL_DEBUG", "value": "INFO"}
    # the role's own UCX_TLS wins, and the name appears once (server-side apply needs unique names)
    assert [e for e in env if e["name"] == "UCX_TLS"] == [{"name": "UCX_TLS", "value": "tcp"}]
