"""The operator's own configuration: what a CR does not say, the operator decides from here.

Kept apart from the renderer so render stays a pure function of (CR, OperatorConfig).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

from tandem.operator.policy import ALWAYS, POLICY_ENV, Policy

# One field manager for every server-side apply the operator makes.
FIELD_MANAGER = "tandem-operator"
# Co-owns a Deployment's replicas for a moment while the operator hands them to an HPA or KEDA.
HANDOVER_MANAGER = "tandem-operator-handover"

DEFAULT_IMAGE_REPOSITORY = "ghcr.io/tandem-dev/tandem-worker"
DEFAULT_ROUTER_REPOSITORY = "ghcr.io/tandem-dev/tandem-router"  # the Dockerfile's `router` target
# runtime vllm's workers: Tandem's worker with vLLM (`tandem worker --runtime vllm`), docs/runtimes.md
DEFAULT_VLLM_REPOSITORY = "ghcr.io/tandem-dev/tandem-worker-vllm"
DEFAULT_IMAGE_TAG = "0.1.0"
DEFAULT_PULL_POLICY = "IfNotPresent"
DEFAULT_RESYNC_SECONDS = 60.0
DEFAULT_KV_PROBE_TIMEOUT_SECONDS = 3.0
DEFAULT_METRICS_TIMEOUT_SECONDS = 3.0
DEFAULT_API_TIMEOUT_SECONDS = 30.0
DEFAULT_HUB_ENDPOINT = "https://huggingface.co"


def _env_flag(value: str | None, default: bool) -> bool:
    if value is None or value == "":
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class OperatorConfig:
    """Operator-wide settings; flags of `tandem operator` override the TANDEM_* environment."""

    image_repository: str = DEFAULT_IMAGE_REPOSITORY  # the workers' image
    image_tag: str = DEFAULT_IMAGE_TAG
    router_repository: str = DEFAULT_ROUTER_REPOSITORY  # the router's own image (no torch)
    router_tag: str = DEFAULT_IMAGE_TAG
    vllm_repository: str = DEFAULT_VLLM_REPOSITORY  # runtime vllm's workers (spec.runtime.image overrides)
    vllm_tag: str = DEFAULT_IMAGE_TAG
    pull_policy: str = DEFAULT_PULL_POLICY
    resync_seconds: float = DEFAULT_RESYNC_SECONDS
    kv_probe: bool = True  # GET each ready router's report: the workers' KV health and parity
    kv_probe_timeout_s: float = DEFAULT_KV_PROBE_TIMEOUT_SECONDS
    metrics_timeout_s: float = DEFAULT_METRICS_TIMEOUT_SECONDS  # the planner's GET of one pod's /metrics
    # Annotate the pods a scale-down removes (pod-deletion-cost): needs `pods: patch` where they run.
    mark_pods: bool = False
    # Where the operator's own pods run and their labels: the NetworkPolicy lets them reach the
    # workers' http port (KV probe, metrics). None when the operator runs outside the cluster.
    namespace: str | None = None
    pod_labels: tuple[tuple[str, str], ...] = ()
    # The Hugging Face hub (or a mirror) the operator resolves revisions on and downloads come from.
    hub_endpoint: str = DEFAULT_HUB_ENDPOINT
    # What an InferenceService may ask of a node, per namespace (tandem.operator.policy): secure by default.
    policy: Policy = Policy()

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> OperatorConfig:
        """TANDEM_WORKER_IMAGE (repo[:tag]), TANDEM_ROUTER_IMAGE (repo[:tag]), TANDEM_VLLM_IMAGE (repo[:tag]:
        runtime vllm's workers), TANDEM_IMAGE_PULL_POLICY, TANDEM_RESYNC_SECONDS,
        TANDEM_KV_PROBE (0 turns probing off), TANDEM_KV_PROBE_TIMEOUT_SECONDS,
        TANDEM_METRICS_TIMEOUT_SECONDS, TANDEM_MARK_PODS_FOR_REMOVAL (1 turns marking on), POD_NAMESPACE and
        TANDEM_OPERATOR_POD_LABELS (a JSON object: the operator pods' labels, set by the chart),
        HF_ENDPOINT (the hub or a mirror, as huggingface_hub reads it), TANDEM_POLICY (JSON: what an
        InferenceService may ask of a node; raises PolicyError when unreadable).
        TANDEM_API_TIMEOUT_SECONDS bounds every API call (read in tandem.operator.apply)."""
        env = dict(os.environ if env is None else env)
        repo, tag = split_image(env.get("TANDEM_WORKER_IMAGE", ""))
        router_repo, router_tag = split_image(env.get("TANDEM_ROUTER_IMAGE", ""))
        vllm_repo, vllm_tag = split_image(env.get("TANDEM_VLLM_IMAGE", ""))
        return cls(
            image_repository=repo or DEFAULT_IMAGE_REPOSITORY,
            image_tag=tag or DEFAULT_IMAGE_TAG,
            router_repository=router_repo or DEFAULT_ROUTER_REPOSITORY,
            router_tag=router_tag or DEFAULT_IMAGE_TAG,
            vllm_repository=vllm_repo or DEFAULT_VLLM_REPOSITORY,
            vllm_tag=vllm_tag or DEFAULT_IMAGE_TAG,
            pull_policy=env.get("TANDEM_IMAGE_PULL_POLICY") or DEFAULT_PULL_POLICY,
            resync_seconds=float(env.get("TANDEM_RESYNC_SECONDS") or DEFAULT_RESYNC_SECONDS),
            kv_probe=_env_flag(env.get("TANDEM_KV_PROBE"), True),
            kv_probe_timeout_s=float(
                env.get("TANDEM_KV_PROBE_TIMEOUT_SECONDS") or DEFAULT_KV_PROBE_TIMEOUT_SECONDS
            ),
            metrics_timeout_s=float(
                env.get("TANDEM_METRICS_TIMEOUT_SECONDS") or DEFAULT_METRICS_TIMEOUT_SECONDS
            ),
            mark_pods=_env_flag(env.get("TANDEM_MARK_PODS_FOR_REMOVAL"), False),
            namespace=env.get("POD_NAMESPACE") or None,
            pod_labels=tuple(sorted(json.loads(env.get("TANDEM_OPERATOR_POD_LABELS") or "{}").items())),
            hub_endpoint=(env.get("HF_ENDPOINT") or DEFAULT_HUB_ENDPOINT).rstrip("/"),
            policy=Policy.from_json(env.get(POLICY_ENV) or ""),
        )

    @property
    def own_images(self) -> tuple[str, ...]:
        """The worker, router and vLLM worker repositories the operator defaults to: every policy
        allows them."""
        return self.image_repository, self.router_repository, self.vllm_repository

    def for_namespace(self, namespace: str) -> OperatorConfig:
        """The config an InferenceService of `namespace` renders with: every image pulled Always where
        the policy forces it (docs/install.md)."""
        if self.policy.rules(namespace).always_pull_images and self.pull_policy != ALWAYS:
            return replace(self, pull_policy=ALWAYS)
        return self


def split_image(image: str) -> tuple[str, str]:
    """'registry:5000/repo:tag' -> ('registry:5000/repo', 'tag'); a digest stays in the tag."""
    if not image:
        return "", ""
    if "@" in image:
        repo, digest = image.split("@", 1)
        return repo, "@" + digest
    last = image.rsplit("/", 1)[-1]
    if ":" in last:
        repo, tag = image.rsplit(":", 1)
        return repo, tag
    return image, ""
