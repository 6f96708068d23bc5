"""What spec.gateway and router.flowControl render (pure): nothing of the gateway without it; with
it, the picker reads the router's file, the sidecar a file of its own whose change rolls decode
only; the flow control keys are ones the router accepts."""

from __future__ import annotations

from tandem.operator.config import OperatorConfig
from tandem.operator.render import render
from tandem.operator.render.config_files import router_config
from tandem.router.config import RouterConfig, apply

BASE = {"model": {"path": "/m", "maxModelLen": 2048}}


def _by(manifests):
    return {(m["kind"], m["metadata"]["name"]): m for m in manifests}


def test_without_a_gateway_nothing_of_it_is_rendered(typed, meta):
    out = _by(render(meta, typed(BASE), OperatorConfig()))
    assert not [k for k in out if k[0] in ("InferencePool", "HTTPRoute") or k[1].endswith("-picker")]
    decode = out[("Deployment", "llama-decode")]["spec"]["template"]["spec"]
    assert [c["name"] for c in decode["containers"]] == ["worker"]
    assert "sidecar.yaml" not in out[("ConfigMap", "llama-config")]["data"]


def test_the_sidecars_file_rolls_decode_only(typed, meta):
    def hashes(**router):
        out = _by(render(meta, typed({**BASE, "router": router, "gateway": {"enabled": True}}), OperatorConfig()))
        return {role: out[("Deployment", f"llama-{role}")]["spec"]["template"]["metadata"]["annotations"]
                ["tandem.dev/config-hash"] for role in ("prefill", "decode", "router", "picker")}

    before, after = hashes(), hashes(limits={"maxBodyBytes": 4096})
    assert before["prefill"] == after["prefill"]
    assert before["decode"] != after["decode"]  # its sidecar reads the router's limits
    assert before["router"] != after["router"] and after["router"] == after["picker"]  # one file


def test_flow_control_renders_keys_the_router_takes(typed):
    spec = typed({**BASE, "router": {"flowControl": {"maxConcurrentRequests": 4, "ttlSeconds": 2.5,
                                                     "objectives": {"batch": -5}}}})
    config = apply(RouterConfig(), router_config("llama", "serving", spec), "rendered")
    assert (config.max_concurrent_requests, config.flow_ttl_s, config.objectives) == (4, 2.5, {"batch": -5})
    off = router_config("llama", "serving", typed(BASE))
    assert "max_concurrent_requests" not in off  # off: the file is as before
