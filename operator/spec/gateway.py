"""`spec.gateway`: Tandem behind a gateway of the Gateway API Inference Extension (docs/gateway.md,
tandem.contracts.gateway). Declared like the rest of the spec (tandem.operator.spec.fields)."""

from __future__ import annotations

from tandem.contracts import gateway
from tandem.operator.spec.fields import Rule, api_field
from tandem.operator.spec.model import DNS_SUBDOMAIN, api_type

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


@api_type
class ParentRef:
    """A Gateway the rendered HTTPRoute attaches to (Gateway API `parentRefs`)."""

    name: str = api_field("name", max_length=253, pattern=DNS_SUBDOMAIN, description="The Gateway's name.")
    namespace: str | None = api_field(
        "namespace", max_length=63, pattern=DNS_LABEL,
        description="The Gateway's namespace (default: the InferenceService's).")
    section_name: str | None = api_field(
        "sectionName", max_length=253, pattern=DNS_SUBDOMAIN, description="One listener of the Gateway.")


@api_type
class GatewaySpec:
    """An InferencePool of the decode pods with Tandem's endpoint picker, for a gateway that implements
    the Gateway API Inference Extension (its CRDs come with that gateway, not with Tandem)."""

    enabled: bool = api_field(
        "enabled", default=False,
        description="Render the InferencePool (inference.networking.k8s.io/v1) of the decode pods, the endpoint "
        "picker (Tandem's router serving ext_proc) with its Service, and a sidecar in each decode pod that "
        "serves the OpenAI API there. The router Service stays the way in without a gateway.")
    failure_mode: str = api_field(
        "failureMode", enum=["FailOpen", "FailClose"], default="FailOpen",
        description="What the gateway does when the picker does not answer: FailOpen sends the request to "
        "any decode pod (whose sidecar prefills it there), FailClose refuses it.")
    picker_replicas: int = api_field(
        "pickerReplicas", minimum=1, maximum=16, default=1,
        description="Endpoint picker pods. Each routes by its own view of the workers, as routers do; "
        "readiness (gRPC health) says whether one can serve.")
    parent_refs: tuple[ParentRef, ...] | None = api_field(
        "parentRefs", max_items=16,
        description="Gateways to attach an HTTPRoute to (every path to the InferencePool); none: no HTTPRoute "
        "is rendered (docs/gateway.md has one to adapt).")


SIDECAR_PORT = gateway.SIDECAR_PORT
PICKER_PORT = gateway.PICKER_PORT
GATEWAY_RULES = (
    Rule("!has(self.gateway) || !self.gateway.enabled || self.decode.parallelism.nodes == 1",
         "gateway.enabled: the InferencePool's decode pods each serve the OpenAI API through their sidecar; a "
         "decode group that spans nodes (decode.parallelism.nodes > 1) cannot be behind a gateway yet"),
    Rule("!has(self.gateway) || !self.gateway.enabled || !has(self.runtime) || self.runtime.name != 'vllm'",
         "gateway.enabled works with runtime tandem: the decode pods' sidecar and the picker route Tandem "
         "workers (a vLLM pool behind a gateway is llm-d's or the extension's own picker)"),
)
