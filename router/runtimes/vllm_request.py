"""What the `vllm` runtime's client sends vLLM for a worker request, pure: the /v1/completions body
of a prefill, and of a decode with what it must drop from vLLM's stream (`DecodeCall`).

The prompt always travels as token ids (the router tokenizes with the model's files, the `tokenizer`
folder), so prefill and decode see the same ids. How a decode continues after tokens the client
already has (`GenerateRequest.generated_token_ids`):

- a KV handoff (`kv_source` set): vLLM's decode server takes the prompt whose KV it pulls, exactly
  the prefill's (its NixlConnector reads the blocks of `prompt_token_ids` and no more), and samples
  the first token again from the same logits with the same seed; the client drops that token (and
  its text) after checking it is the prefill's. Every later token is what a colocated vLLM would
  have produced: penalties, stop strings and the grammar all saw the first token as output.
- a resume after a decode died (no KV): the tokens so far are appended to the prompt and only what
  follows is streamed (`max_tokens` and `min_tokens` less what is already out). With a grammar the
  state of the grammar matters, so vLLM instead regenerates from the prompt with the same seed and
  the client drops the tokens the client has, each checked.

Sampling without a seed gets one derived from the request id, so prefill and decode (and a replay)
draw the same tokens. Fields vLLM's completions API cannot take are refused with the router's 400.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from tandem.contracts.protocol import GenerateRequest
from tandem.contracts.sampling import GREEDY_TEMPERATURE_BELOW, SamplingParams
from tandem.router.errors import RouterError, bad_request

KV_TRANSFER_PARAMS = "kv_transfer_params"  # where a KVSource of this runtime keeps vLLM's dict (extra)
INT64 = 2**63


@dataclass
class DecodeCall:
    """One decode call: the body to POST, and what of vLLM's stream the client already has."""

    body: dict[str, Any]
    skip_tokens: list[int] = field(default_factory=list)  # vLLM regenerates these: drop each, checked
    skip_chars: int | None = None  # text the client has of them (None: the text of those tokens)
    prompt_tokens: int = 0  # the client's prompt (what START reports)
    replayed: list[int] = field(default_factory=list)  # appended to the prompt (a resume)
    emitted_chars: int | None = None  # of `replayed`: what the client has of their text


def derived_seed(request_id: str) -> int:
    """A seed for a sampled request that names none: the same for every call of one request."""
    return int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "big") >> 1


def vllm_seed(seed: int) -> int:
    """A 64-bit seed as vLLM takes it (a signed 64-bit integer; the generator reads it mod 2**64)."""
    return seed - 2 * INT64 if seed >= INT64 else seed


def structured_outputs(spec: dict[str, Any]) -> dict[str, Any]:
    """vLLM's structured_outputs for a spec (one kind, as validation.py checked). Whether JSON may
    hold free whitespace is the server's setting in vLLM 0.32, not the request's: Tandem launches
    vLLM with compact JSON, as its engine writes (contracts/vllm_serve.py STRUCTURED_OUTPUTS)."""
    kind, value = next(iter(spec.items()))
    if kind == "json_schema":
        return {"json": value}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "lark":  # llguidance's Lark (Tandem's engine's); vLLM's xgrammar reads it too, %json included
        return {"grammar": value}
    if kind in ("regex", "choice"):
        return {kind: value}
    raise bad_request(f"structured output {kind[:40]!r} is not supported by this server.", "response_format")


def _sampling_fields(s: SamplingParams, request_id: str) -> dict[str, Any]:
    if s.forced_token_ids:
        raise bad_request("forced_token_ids (the handoff parity probe's teacher forcing) is not supported "
                          "by the vllm runtime: run the router with --no-parity-probe.", "forced_token_ids")
    greedy = s.temperature < GREEDY_TEMPERATURE_BELOW
    seed = s.seed if s.seed is not None or greedy else derived_seed(request_id)
    out: dict[str, Any] = {
        "temperature": 0.0 if greedy else s.temperature, "top_p": s.top_p, "stop": list(s.stop),
        "stop_token_ids": list(s.stop_token_ids), "ignore_eos": s.ignore_eos, "min_p": s.min_p,
        "presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty,
        "repetition_penalty": s.repetition_penalty,
    }
    if s.top_k > 0:
        out["top_k"] = s.top_k
    if seed is not None:
        out["seed"] = vllm_seed(seed)
    if s.logit_bias:
        out["logit_bias"] = dict(s.logit_bias)
    if s.logprobs is not None:  # ids, not texts: the client names each token as Tandem's workers do
        out |= {"logprobs": s.logprobs, "return_tokens_as_token_ids": True}
    if s.structured is not None:
        out["structured_outputs"] = structured_outputs(s.structured)
    return out


def _prompt(req: GenerateRequest) -> list[int]:
    if req.prompt_token_ids is None:
        # The router tokenizes every request with the `tokenizer` folder this runtime requires; a
        # request without ids means it could not, and vLLM's own tokenization might differ.
        raise RouterError(500, "the vllm runtime needs token ids: run the router with --tokenizer DIR (the "
                          "served model's tokenizer files).", "server_error", None, "tokenizer_unavailable")
    if not req.prompt_token_ids:
        raise bad_request("the prompt is empty.", "prompt")
    return list(req.prompt_token_ids)


def room(max_tokens: int, prompt_len: int, max_model_len: int | None) -> int:
    """max_tokens within the context (Tandem's engine stops there with `length`; vLLM would refuse)."""
    if max_model_len and prompt_len < max_model_len:
        return max(1, min(max_tokens, max_model_len - prompt_len))
    return max_tokens


def _common(req: GenerateRequest, prompt: list[int]) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": prompt, "return_token_ids": True}
    if req.cache_salt:
        body["cache_salt"] = req.cache_salt
    return body


def prefill_body(req: GenerateRequest, model: str, max_model_len: int | None = None) -> dict[str, Any]:
    """The prefill: the prompt and one token, its KV kept for a decode server to read."""
    prompt = _prompt(req)
    s = req.sampling
    return _common(req, prompt) | _sampling_fields(s, req.request_id) | {
        "model": model, "max_tokens": 1, "min_tokens": min(s.min_tokens, 1), "stream": False,
        KV_TRANSFER_PARAMS: {"do_remote_decode": True},
    }


def decode_call(req: GenerateRequest, model: str, max_model_len: int | None = None) -> DecodeCall:
    """The decode (or a whole generation) and what of its stream the client already has."""
    prompt = _prompt(req)
    s = req.sampling
    done = list(req.generated_token_ids or ([req.first_token_id] if req.first_token_id is not None else []))
    call = DecodeCall({}, prompt_tokens=len(prompt))
    body = _common(req, prompt) | _sampling_fields(s, req.request_id) | {
        "model": model, "stream": True, "stream_options": {"include_usage": True}}
    kv = req.kv_source.extra.get(KV_TRANSFER_PARAMS) if req.kv_source is not None else None
    if req.kv_source is not None and not isinstance(kv, dict):
        raise RouterError(400, "kv_source carries no vLLM kv_transfer_params: it was not leased by a vllm "
                          "prefill server.", "invalid_request_error", "kv_source", "kv_backend_mismatch")
    if kv is not None or (done and s.structured is not None):
        call.skip_tokens, call.skip_chars = done, req.emitted_chars
        body |= {"max_tokens": room(s.max_tokens, len(prompt), max_model_len), "min_tokens": s.min_tokens}
        if kv is not None:
            body[KV_TRANSFER_PARAMS] = kv
    else:
        if len(done) >= s.max_tokens:
            raise bad_request(f"generated_token_ids already holds {len(done)} tokens, max_tokens is "
                              f"{s.max_tokens}: nothing left to generate", "max_tokens")
        full = prompt + done
        body |= {"prompt": full, "max_tokens": room(s.max_tokens - len(done), len(full), max_model_len),
                 "min_tokens": max(0, s.min_tokens - len(done))}
        call.replayed, call.emitted_chars = done, req.emitted_chars
    call.body = body
    return call
