"""A handoff that proves itself, on the real control plane: real workers and a real router stand in
for the pods (KWOK gives them loopback IPs), the operator (a subprocess) reads the router's parity
report and the workers' KV health.

- A decode worker with other weights (a toy model of another seed: same shapes and tokenizer) makes
  HandoffVerified False/ParityMismatch with the measured difference, and one Warning event; the same
  pod's worker replaced by one with the right weights makes it True/Verified.
- A prefill worker whose TCP transport is throttled below spec.kvTransfer.minBandwidthGBps (the
  test-only TANDEM_TEST_KV_THROTTLE_BYTES_PER_S) makes KVTransferReady False/BandwidthBelowFloor,
  naming the worker, what it measured and the usual causes; the handoff itself stays correct.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kubernetes import client
from tandem.testing.cluster import wait_until
from tandem.testing.k8s_events import wait_events
from tandem.testing.kube_nodes import POOL_LABEL
from tandem.testing.pod_workers import ready_pods
from tandem.worker.kv.throttle import ENV as THROTTLE_ENV

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.e2e]

GVP = ("tandem.dev", "v1alpha1", "inferenceservices")


def spec(model: Path, floor_gbps: float) -> dict:
    role = {"replicas": 1, "gpus": 0, "cpu": "100m", "memory": "1Gi", "nodeSelector": {POOL_LABEL: "cpu"}}
    return {"model": {"path": str(model), "dtype": "float32", "maxModelLen": 512},
            "prefill": role, "decode": role, "router": {"cpu": "50m", "memory": "128Mi"},
            "kvTransfer": {"backend": "tcp", "minBandwidthGBps": floor_gbps}}


@pytest.fixture(scope="module")
def operator(start_operator):
    return start_operator("--resync-seconds", "1", "--kv-probe-timeout-seconds", "2")


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tandem.worker.local.toy_model import make_toy_model

    return make_toy_model(tmp_path_factory.mktemp("other") / "toy-llama-seed1", seed=1)


def create(api, namespace: str, name: str, body_spec: dict) -> dict[str, dict]:
    """Applies the InferenceService and returns its Ready pod per role (prefill, decode, router)."""
    body = {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name},
            "spec": body_spec}
    client.CustomObjectsApi(api).create_namespaced_custom_object(*GVP[:2], namespace, GVP[2], body)
    return {role: wait_until(lambda r=role: ready_pods(api, namespace, name, r) or None, timeout=60,
                             what=f"a Ready {role} pod")[0] for role in ("prefill", "decode", "router")}


def wait_condition(api, namespace: str, name: str, type_: str, status: str, reason: str,
                   timeout: float = 90, naming: tuple[str, ...] = ()) -> dict:
    last: dict = {}

    def check():
        nonlocal last
        tis = client.CustomObjectsApi(api).get_namespaced_custom_object(*GVP[:2], namespace, GVP[2], name)
        last = next((c for c in (tis.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})
        found = (last.get("status"), last.get("reason")) == (status, reason)
        return last if found and all(n in last.get("message", "") for n in naming) else None

    try:
        return wait_until(check, timeout=timeout, what=f"{type_} {status}/{reason}")
    except TimeoutError:
        raise AssertionError(f"{type_} never became {status}/{reason} naming {naming}; last: {last}") from None


def test_a_decode_worker_with_other_weights_fails_handoff_verified_until_it_is_replaced(
    k8s, api, operator, namespace, procs, toy_model_dir, other_model_dir
):
    name = "parity"
    pods = create(api, namespace, name, spec(toy_model_dir, floor_gbps=0.00001))
    prefill = procs.worker_for_pod(pods["prefill"], toy_model_dir)
    wrong = procs.worker_for_pod(pods["decode"], other_model_dir)
    procs.wait_ready([prefill, wrong])
    procs.wait_ready([procs.router_for_pod(pods["router"], k8s.kubeconfig)])
    decode_pod = pods["decode"]["metadata"]["name"]

    c = wait_condition(api, namespace, name, "HandoffVerified", "False", "ParityMismatch", naming=(decode_pod,))
    assert "max |logprob difference|" in c["message"] and "tolerance 0.0001" in c["message"], c
    assert "prefilled on the decode pool" in c["message"]
    events = wait_events(api, namespace, name, lambda e: e.reason == "ParityMismatch" and e.type == "Warning",
                         "a Warning event ParityMismatch")
    assert len(events) == 1 and decode_pod in events[0].message
    ready = wait_condition(api, namespace, name, "Ready", "True", "AllComponentsReady")
    assert ready, "decode-side prefill still serves: Ready is about capacity"
    kv = wait_condition(api, namespace, name, "KVTransferReady", "True", "Healthy",
                        naming=("KV handoffs measured: tcp over tcp",))
    assert "minBandwidthGBps" not in kv["message"]

    wrong.kill()  # the pod's container restarts with the right weights (same pod, same address)
    procs.wait_ready([procs.worker_for_pod(pods["decode"], toy_model_dir)])
    c = wait_condition(api, namespace, name, "HandoffVerified", "True", "Verified")
    assert "2 workers proven" in c["message"] and "largest |logprob difference| 0 " in c["message"], c


def test_a_transport_throttled_below_the_floor_fails_kv_transfer_ready(
    k8s, api, operator, namespace, procs, toy_model_dir
):
    name = "slow"
    pods = create(api, namespace, name, spec(toy_model_dir, floor_gbps=0.0005))
    # 50 kB/s: the parity probe's handoff (96 tokens, 48 KiB) takes about a second
    prefill = procs.worker_for_pod(pods["prefill"], toy_model_dir, env={THROTTLE_ENV: "50000"})
    decode = procs.worker_for_pod(pods["decode"], toy_model_dir)
    procs.wait_ready([prefill, decode])
    procs.wait_ready([procs.router_for_pod(pods["router"], k8s.kubeconfig)])
    decode_pod = pods["decode"]["metadata"]["name"]

    c = wait_condition(api, namespace, name, "KVTransferReady", "False", "BandwidthBelowFloor", naming=(decode_pod,))
    assert f"pod {decode_pod} (decode) moves KV over tcp over tcp at ~" in c["message"], c
    assert "below kvTransfer.minBandwidthGBps 0.0005" in c["message"]
    assert "UCX_IB_ADDR_TYPE" in c["message"] and "fell back to TCP" in c["message"]
    events = wait_events(api, namespace, name, lambda e: e.reason == "BandwidthBelowFloor" and e.type == "Warning",
                         "a Warning event BandwidthBelowFloor")
    assert len(events) == 1
    # slow, but the bytes are right: the same probe proved the pairing
    wait_condition(api, namespace, name, "HandoffVerified", "True", "Verified")
