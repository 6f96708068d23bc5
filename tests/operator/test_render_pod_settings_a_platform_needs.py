"""Pod settings a platform needs, per worker role and for the router (issue 21, Operations): priority,
runtime class, pull secrets, ServiceAccount, PodDisruptionBudgets; and a non-root RDMA worker. Pure."""

from __future__ import annotations

from tandem.operator.config import OperatorConfig
from tandem.operator.render import render
from tandem.testing.pod_security import restricted_violations

CONFIG = OperatorConfig()
SETTINGS = {"priorityClassName": "serving", "runtimeClassName": "nvidia",
            "imagePullSecrets": [{"name": "regcred"}], "serviceAccountName": "weights-reader"}


def _by(manifests: list[dict], kind: str, name: str) -> dict:
    return next(m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name)


def _pod(manifests: list[dict], component: str) -> dict:
    return _by(manifests, "Deployment", f"llama-{component}")["spec"]["template"]["spec"]


def test_each_component_gets_its_own_settings(typed, meta):
    spec = typed({"model": {"path": "/m"}, "decode": dict(SETTINGS),
                  "router": {"priorityClassName": "edge", "imagePullSecrets": [{"name": "router-pull"}]}})
    out = render(meta, spec, CONFIG)
    decode = _pod(out, "decode")
    assert {k: decode[k] for k in SETTINGS} == {**SETTINGS, "imagePullSecrets": [{"name": "regcred"}]}
    assert decode["automountServiceAccountToken"] is False, "a worker's account is for its cloud identity only"
    prefill = _pod(out, "prefill")
    assert not set(SETTINGS) & set(prefill), "prefill sets none: the cluster's defaults"
    router = _pod(out, "router")
    assert (router["priorityClassName"], router["imagePullSecrets"]) == ("edge", [{"name": "router-pull"}])
    assert router["serviceAccountName"] == "llama-router" and "runtimeClassName" not in router


def test_the_router_can_run_as_an_existing_service_account(typed, meta):
    out = render(meta, typed({"model": {"path": "/m"}, "router": {"serviceAccountName": "platform-sa"}}), CONFIG)
    assert _pod(out, "router")["serviceAccountName"] == "platform-sa"
    assert not [m for m in out if m["kind"] == "ServiceAccount"], "none created: the platform brings it"
    binding = _by(out, "RoleBinding", "llama-router")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "platform-sa", "namespace": "serving"}]


def test_every_component_has_a_disruption_budget_unless_turned_off(typed, meta):
    spec = typed({"model": {"path": "/m"}, "decode": {"podDisruptionBudget": {"maxUnavailable": "25%"}},
                  "prefill": {"podDisruptionBudget": {"minAvailable": 1}},
                  "router": {"podDisruptionBudget": {"enabled": False}}})
    out = render(meta, spec, CONFIG)
    budgets = {m["metadata"]["name"]: m["spec"] for m in out if m["kind"] == "PodDisruptionBudget"}
    assert budgets == {
        "llama-prefill": {"minAvailable": 1, "selector": {"matchLabels": {
            "tandem.dev/service": "llama", "tandem.dev/role": "prefill"}}},
        "llama-decode": {"maxUnavailable": "25%", "selector": {"matchLabels": {
            "tandem.dev/service": "llama", "tandem.dev/role": "decode"}}},
    }
    default = render(meta, typed({"model": {"path": "/m"}}), CONFIG)
    assert _by(default, "PodDisruptionBudget", "llama-router")["spec"]["maxUnavailable"] == 1
    pdb = _by(default, "PodDisruptionBudget", "llama-decode")
    assert pdb["metadata"]["ownerReferences"][0]["uid"] == meta["uid"]
    deployment = _by(default, "Deployment", "llama-decode")
    assert pdb["spec"]["selector"] == deployment["spec"]["selector"], "the budget covers exactly the role's pods"


def test_an_rdma_worker_runs_as_non_root_unless_it_asks_for_ipc_lock(typed, meta):
    """Where the container runtime gives containers an unlimited RLIMIT_MEMLOCK (and the device plugin's
    device files are open to the pod's user), RDMA needs no capability: the worker stays Restricted."""
    rdma = {"backend": "nixl", "rdma": {"resourceName": "rdma/rdma_shared_device_a", "count": 1}}
    roles = {"gpus": 1}
    plain = _pod(render(meta, typed({"model": {"path": "/m"}, "prefill": roles, "decode": roles,
                                     "kvTransfer": rdma}), CONFIG), "decode")
    assert restricted_violations(plain) == []
    assert plain["containers"][0]["resources"]["limits"]["rdma/rdma_shared_device_a"] == "1"
    locked = _pod(render(meta, typed({"model": {"path": "/m"}, "prefill": roles, "decode": roles,
                                      "kvTransfer": rdma | {"ipcLock": True}}), CONFIG), "decode")
    security = locked["containers"][0]["securityContext"]
    assert security["capabilities"]["add"] == ["IPC_LOCK"] and security["runAsUser"] == 0
    assert restricted_violations(locked), "IPC_LOCK is outside Restricted (and Baseline)"


def test_the_router_runs_its_own_image(typed, meta):
    """The router has its own image (no torch): the operator's router image, spec.router.image over it,
    and a version spec.image pins for the workers pins the router's tag too (not a digest)."""
    config = OperatorConfig(image_repository="reg/worker", image_tag="1.0", router_repository="reg/router",
                            router_tag="1.0", pull_policy="IfNotPresent")

    def images(raw: dict) -> tuple[str, str, str]:
        out = render(meta, typed({"model": {"path": "/m"}} | raw), config)
        router = _pod(out, "router")["containers"][0]
        return _pod(out, "decode")["containers"][0]["image"], router["image"], router["imagePullPolicy"]

    assert images({}) == ("reg/worker:1.0", "reg/router:1.0", "IfNotPresent")
    assert images({"image": {"tag": "1.1", "pullPolicy": "Always"}}) == ("reg/worker:1.1", "reg/router:1.1", "Always")
    assert images({"router": {"image": {"repository": "mirror/router", "tag": "2.0", "pullPolicy": "Never"}},
                   "image": {"tag": "1.1"}}) == ("reg/worker:1.1", "mirror/router:2.0", "Never")
    digest = "sha256:" + "b" * 64
    assert images({"image": {"tag": digest}}) == (f"reg/worker@{digest}", "reg/router:1.0", "IfNotPresent")
    a = render(meta, typed({"model": {"path": "/m"}}), config)
    b = render(meta, typed({"model": {"path": "/m"}, "router": {"image": {"tag": "9"}}}), config)
    label = "tandem.dev/kv-compat"
    assert (_by(a, "Deployment", "llama-decode")["spec"]["template"]["metadata"]["labels"][label]
            == _by(b, "Deployment", "llama-decode")["spec"]["template"]["metadata"]["labels"][label]), \
        "a router image does not change what prefill and decode must share"
