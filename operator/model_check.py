"""Before any pod downloads weights: pin a hub model's revision to a commit and judge its config.json.

For `model.hub` the operator resolves the revision (default main) to the commit it names now, reads
config.json at that commit, and asks the same pure functions the workers ask at start
(tandem.contracts.model_support.check_model_config for the architecture and what a tensor size
must divide, tandem.contracts.parallelism.check_parallelism for the prefill and decode sizes
against the heads) whether it can be served. The
commit is kept in status.model and served until model.hub or model.revision change (a branch that
moves upstream does not roll the workers); the judgement is redone when a tensor size changes.

The outcome is the ModelReady condition; a hub model that cannot be resolved, or cannot be served,
applies nothing (Ready=False with ModelReady's reason): no pod is created to download it. Once
checked, a hub model with cache.pvc says how its download Job fares (tandem.operator.download_state:
Downloading, Downloaded, DownloadFailed). Sources the operator cannot read (a path in the image, a
hostPath, a PVC, an image volume) get ModelReady Unknown/NotChecked: their workers refuse the same
things, with the same words, when they start; a PVC's claim is read, though, and one the worker pods
cannot all mount says so (tandem.operator.claim_check).
"""

from __future__ import annotations

import base64
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException
from tandem.contracts.runtimes import Runtime
from tandem.operator import api_client
from tandem.operator.claim_check import judge_claim
from tandem.operator.config import OperatorConfig
from tandem.operator.download_state import download_condition, pods_download_condition
from tandem.operator.render.objects import names
from tandem.operator.render.weights import DOWNLOAD_INIT, download_job_name
from tandem.operator.spec import InferenceServiceSpec
from tandem.operator.status import condition
from tandem.weights.cli import EXIT_PERMANENT
from tandem.weights.hub import HubError, fetch_config, resolve_commit

log = logging.getLogger(__name__)
TYPE = "ModelReady"
# Reasons the model check does not find itself: the download Job's state, layered on a Checked finding
# in every pass (with_download); a pass that does not check starts again from Checked.
DOWNLOAD_REASONS = ("Downloading", "Downloaded", "DownloadFailed")  # also the pods' own downloads
# False findings that still apply the spec (the pods wait for what is missing, then start).
APPLYING = ("ClaimNotFound", "DownloadFailed")


@dataclass(frozen=True)
class ModelFinding:
    """What the check found: the spec to render (a hub model pinned to its commit), status.model,
    the ModelReady condition, and whether nothing may be applied."""

    spec: InferenceServiceSpec
    status: dict[str, Any] | None
    condition: dict[str, str]
    blocking: bool = False


def pinned(spec: InferenceServiceSpec, commit: str) -> InferenceServiceSpec:
    """The spec with model.revision set to the commit: what render, the generation and the download use."""
    return dataclasses.replace(spec, model=dataclasses.replace(spec.model, revision=commit))


def judge(config_json: dict[str, Any], spec: InferenceServiceSpec) -> tuple[str, str] | None:
    """(reason, message) when the workers could not serve this config.json as the spec asks; None if
    they can. The words are the contracts' own, as the workers say them: the architecture
    (model_support), the prefill and decode tensor sizes against the heads (parallelism: any two
    sizes that each fit can hand KV over), then what else a size must divide (experts) or the path
    a model runs on allows (model_support again)."""
    from tandem.contracts.model_support import check_model_config
    from tandem.contracts.parallelism import ParallelismError, check_parallelism

    if spec.runtime.name is Runtime.VLLM:
        return judge_vllm(config_json, spec)
    architecture = check_model_config(config_json, 1)
    if architecture is not None:
        return "UnsupportedModel", architecture
    tensors = {role: spec.role(role).parallelism.tensor for role in ("prefill", "decode")}
    heads = config_json.get("num_attention_heads")
    kv_heads = config_json.get("num_key_value_heads") or heads
    if isinstance(heads, int) and isinstance(kv_heads, int):
        try:
            check_parallelism(heads, kv_heads, tensors["prefill"], tensors["decode"])
        except ParallelismError as e:
            return "ParallelismMismatch", str(e)
    for role, tensor in tensors.items():
        problem = check_model_config(config_json, tensor)
        if problem is not None:
            return "ParallelismMismatch", f"{role}.parallelism: {problem}"
    return None


def judge_vllm(config_json: dict[str, Any], spec: InferenceServiceSpec) -> tuple[str, str] | None:
    """judge's answer for runtime vllm: what vLLM serves (tandem.contracts.vllm_model_support), not
    what Tandem's engine does; MLA models such as DeepSeek-V3 pass."""
    from tandem.contracts.vllm_model_support import check_vllm_model_config

    architecture = check_vllm_model_config(config_json, 1)
    if architecture is not None:
        return "UnsupportedModel", architecture
    for role in ("prefill", "decode"):
        problem = check_vllm_model_config(config_json, spec.role(role).parallelism.tensor)
        if problem is not None:
            return "ParallelismMismatch", f"{role}.parallelism: {problem}"
    return None


def checked_at(spec: InferenceServiceSpec) -> dict[str, Any]:
    """What a judgement holds for (status.model.checked): the tensor sizes, and a runtime other than
    tandem (its support differs: a change of runtime judges again)."""
    tensors: dict[str, Any] = {role: spec.role(role).parallelism.tensor for role in ("prefill", "decode")}
    return tensors if spec.runtime.name is Runtime.TANDEM else tensors | {"runtime": spec.runtime.name.value}


def hub_token(api: client.ApiClient, namespace: str, spec: InferenceServiceSpec) -> str | None:
    """The token model.tokenSecretRef names, read for this call only (never logged or stored)."""
    ref = spec.model.token_secret_ref
    if ref is None:
        return None
    try:
        secret = api_client.request(api, "GET", f"/api/v1/namespaces/{namespace}/secrets/{ref.name}")
    except ApiException as e:
        raise TokenError(f"cannot read Secret {ref.name} for model.tokenSecretRef ({e.status}): the operator may "
                         "read only the Secrets the chart names in hub.tokenSecrets") from None
    data = (secret.get("data") or {}).get(ref.key)
    if not data:
        raise TokenError(f"Secret {ref.name} has no key {ref.key!r} (model.tokenSecretRef)")
    return base64.b64decode(data).decode().strip()


class TokenError(Exception):
    """The token Secret cannot be read; the message names it (never its value)."""


def check(api: client.ApiClient, body: dict, spec: InferenceServiceSpec, config: OperatorConfig) -> ModelFinding:
    """The model's finding for this reconcile (hub calls only when status lacks the answer)."""
    model = spec.model
    if model.pvc is not None:
        return _claim_finding(spec, read_claim(api, body["metadata"]["namespace"], model.pvc.claim_name))
    if model.hub is None:
        return ModelFinding(spec, None, condition(TYPE, "Unknown", "NotChecked", not_checked_message(spec)))
    old = (body.get("status") or {}).get("model") or {}
    tensors = checked_at(spec)
    same_source = old.get("hub") == model.hub and old.get("revision") == model.hub_revision
    if same_source and old.get("commit") and old.get("checked") == tensors:
        return _finding(spec, old)  # judged before: the same commit at the same sizes
    namespace = body["metadata"]["namespace"]
    try:
        token = hub_token(api, namespace, spec)
        commit = old["commit"] if same_source and old.get("commit") else resolve_commit(
            model.hub, model.hub_revision, endpoint=config.hub_endpoint, token=token)
        config_json = fetch_config(model.hub, commit, endpoint=config.hub_endpoint, token=token)
        problem = judge(config_json, spec)
    except HubError as e:
        log.warning("%s/%s: model %s: %s", namespace, body["metadata"]["name"], model.hub, e)
        return ModelFinding(spec, old or None, condition(TYPE, "False", str(e.reason), str(e)), blocking=True)
    except TokenError as e:
        return ModelFinding(spec, old or None, condition(TYPE, "False", "TokenUnavailable", str(e)), blocking=True)
    status: dict[str, Any] = {"hub": model.hub, "revision": model.hub_revision, "commit": commit,
                              "checked": tensors}
    if problem is not None:
        status["problem"] = {"reason": problem[0], "message": problem[1]}
    elif spec.runtime.name is Runtime.VLLM:
        from tandem.contracts.vllm_model_support import served_how

        status["served"] = served_how(config_json)
    return _finding(spec, status)


def _finding(spec: InferenceServiceSpec, status: dict[str, Any]) -> ModelFinding:
    where = f"{status['hub']}@{status['revision']}"
    problem = status.get("problem")
    if problem:
        message = f"{where} (commit {status['commit']}) cannot be served: {problem['message']}"
        return ModelFinding(spec, status, condition(TYPE, "False", problem["reason"], message), blocking=True)
    tensors = status["checked"]
    message = (f"{where} is commit {status['commit']}; its config.json can be served with tensor parallelism "
               f"{tensors['prefill']} (prefill) and {tensors['decode']} (decode)"
               + (f"; {status['served']}" if status.get("served") else ""))
    return ModelFinding(pinned(spec, status["commit"]), status, condition(TYPE, "True", "Checked", message))


def read_claim(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any] | None:
    """model.pvc's claim, None when it does not exist."""
    try:
        return api_client.request(api, "GET", f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{name}")
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def _claim_finding(spec: InferenceServiceSpec, claim: dict[str, Any] | None) -> ModelFinding:
    problem = judge_claim(claim, spec)
    if problem is None:
        return ModelFinding(spec, None, condition(TYPE, "Unknown", "NotChecked", not_checked_message(spec)))
    return ModelFinding(spec, None, condition(TYPE, problem.status, problem.reason, problem.message),
                        blocking=problem.blocking)


def downloads(finding: ModelFinding) -> bool:
    """Whether the finding is a checked hub model whose download Job (cache.pvc) tells the rest."""
    model = finding.spec.model
    return (model.hub is not None and model.cache is not None and model.cache.pvc is not None
            and finding.condition["status"] == "True")


def with_download(finding: ModelFinding, service: str, job: dict[str, Any] | None,
                  pods: list[dict[str, Any]]) -> ModelFinding:
    """The finding with ModelReady as the pinned commit's download Job says (see downloads)."""
    model = finding.spec.model
    cond = download_condition(finding.condition["message"], download_job_name(service, model),
                              names(service)["weights"], job, pods)
    return dataclasses.replace(finding, condition=cond)


def with_pod_downloads(finding: ModelFinding, worker_pods: list[dict[str, Any]]) -> ModelFinding:
    """A checked hub model that each pod downloads (a hostPath or emptyDir cache): ModelReady says
    when their download init containers fail."""
    model = finding.spec.model
    if model.hub is None or (model.cache is not None and model.cache.pvc is not None) or \
            finding.condition["status"] != "True":
        return finding
    cond = pods_download_condition(finding.condition, DOWNLOAD_INIT, EXIT_PERMANENT, worker_pods)
    return dataclasses.replace(finding, condition=cond)


def not_checked_message(spec: InferenceServiceSpec) -> str:
    model = spec.model
    source = ("model.path" if model.path else "model.hostPath" if model.host_path else
              "model.pvc" if model.pvc else "model.image")
    return (f"the operator reads config.json only from the hub; with {source} each worker checks it when it "
            "starts (an unsupported architecture or tensor size stops the worker with the reason)")


def carried(body: dict, spec: InferenceServiceSpec | None) -> ModelFinding | None:
    """The last finding, from status alone (a status refresh makes no hub call): the spec pinned to
    the commit status holds for its hub id and revision, and ModelReady as it was."""
    if spec is None:
        return None
    status = body.get("status") or {}
    old = next((c for c in status.get("conditions") or [] if c.get("type") == TYPE), None)
    held = status.get("model") or {}
    model = spec.model
    pin = (spec if model.hub is None or held.get("hub") != model.hub or held.get("revision") != model.hub_revision
           or not held.get("commit") else pinned(spec, held["commit"]))
    if old is None:
        return ModelFinding(pin, held or None, condition(TYPE, "Unknown", "NotChecked", not_checked_message(spec))
                            if model.hub is None else condition(TYPE, "Unknown", "Pending", "not checked yet"))
    if old.get("reason") in DOWNLOAD_REASONS and pin is not spec:
        return _finding(spec, held)  # checked; this pass reads the download Job again
    cond = {k: old[k] for k in ("type", "status", "reason", "message") if k in old}
    return ModelFinding(pin, held or None, cond, blocking=old.get("status") == "False"
                        and old.get("reason") not in APPLYING)
