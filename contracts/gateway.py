"""Names of the Gateway API Inference Extension that Tandem's picker, its decode-side sidecar, the
operator and the tests must agree on (kubernetes-sigs/gateway-api-inference-extension: the endpoint
picker protocol, docs/proposals/004; P/D, docs/proposals/0000-pd-disaggregation; api/v1).

How a request goes through a gateway with Tandem behind it:
1. The gateway asks the picker (`tandem router --ext-proc-port`, Envoy's ext_proc over gRPC) where
   to send it. The picker routes as Tandem's router does (load, prefix, pairing, conditional
   disaggregation) and answers with the decode pod's endpoint (header and `envoy.lb` dynamic
   metadata) and, when the prompt should be prefilled elsewhere, the prefill worker's endpoint.
2. The gateway sends the request to that decode pod's sidecar (`tandem router --gateway-decode`),
   the OpenAI API in front of the pod's worker: it prefills on the named prefill worker, pulls the KV
   and streams the answer from its own worker. Without the header it prefills on its own worker.
"""

from __future__ import annotations

from urllib.parse import urlsplit

# request: data plane -> picker (filter metadata), and picker -> data plane (header + dynamic metadata)
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
DESTINATION_HEADER = "x-gateway-destination-endpoint"
# response: data plane -> picker, which endpoint served it (metadata_context, LB_NAMESPACE)
SERVED_KEY = "x-gateway-destination-endpoint-served"
# P/D: the picker names the prefill worker(s) the decode side pulls KV from
PREFILL_HEADER = "x-gateway-prefill-endpoints"

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_LIVENESS = "liveness"
HEALTH_READINESS = "readiness"

PICKER = "picker"  # the picker's component and tandem.dev/role (operator)
SIDECAR_PORT_NAME = "gateway"  # the decode pod's sidecar container and its port
PICKER_PORT = 9002  # the picker's gRPC port (ext_proc and health), as the extension's own picker
SIDECAR_PORT = 8200  # the decode pod's OpenAI port behind a gateway (the InferencePool's targetPort)

INFERENCE_GROUP = "inference.networking.k8s.io"
INFERENCE_VERSION = "v1"
INFERENCE_POOL_PLURAL = "inferencepools"


def endpoint_of(url: str) -> str:
    """A worker's base URL as the protocol names endpoints: `host:port` (`[v6]:port`)."""
    parts = urlsplit(url)
    if parts.port is None or not parts.hostname:
        raise ValueError(f"not a URL with a host and a port: {url!r}")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{host}:{parts.port}"


def parse_endpoints(value: str | None) -> list[str]:
    """A header's or metadata's `ip:port[,ip:port...]`, in order, blanks dropped."""
    return [e.strip() for e in (value or "").split(",") if e.strip()]
