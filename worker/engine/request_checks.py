"""What a request may ask of the engine, checked where it enters, so nothing one request carries can
fail a step that other requests share: every number finite and in range, a temperature too small
to divide by taken as greedy, stop strings within limits, token ids inside the vocabulary, and a
prompt the tokenizer cannot take refused as a 400 rather than raised from deep inside it.
"""

from __future__ import annotations

import math
from typing import Any

from tandem.contracts.chat_options import template_args
from tandem.contracts.protocol import MAX_CACHE_SALT_CHARS, MAX_FAIRNESS_ID_CHARS, GenerateRequest
from tandem.contracts.sampling import (
    GREEDY_TEMPERATURE_BELOW,
    WORKER_MAX_STOP_CHARS,
    WORKER_MAX_STOP_STRINGS,
    SamplingParams,
    top_k_valid,
)
from tandem.worker.engine.errors import RequestError
from tandem.worker.engine.sampling_checks import check_controls

SEED_RANGE = (-(2**63), 2**64)  # what a 64-bit seed can hold, signed or not


def _bad(msg: str, param: str) -> RequestError:
    return RequestError(msg, param=param, code="invalid_value")


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _real(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def is_token(t: Any, vocab_size: int) -> bool:
    return _int(t) and 0 <= t < vocab_size


def check_sampling(p: SamplingParams, vocab_size: int) -> None:
    """Raise RequestError (400) for anything out of range; normalise in place what has one
    meaning (a tiny temperature is 0, one stop string is a list of one)."""
    if not _int(p.max_tokens) or p.max_tokens < 1:
        raise _bad(f"max_tokens must be an integer >= 1, got {p.max_tokens!r}", "max_tokens")
    if not _real(p.temperature) or p.temperature < 0:
        raise _bad(f"temperature must be a finite number >= 0, got {p.temperature!r}", "temperature")
    if p.temperature < GREEDY_TEMPERATURE_BELOW:
        p.temperature = 0.0
    if not _real(p.top_p) or not 0 < p.top_p <= 1:
        raise _bad(f"top_p must be in (0, 1], got {p.top_p!r}", "top_p")
    if not _int(p.top_k) or not top_k_valid(p.top_k):
        raise _bad(f"top_k must be -1 or 0 (off) or a positive integer, got {p.top_k!r}", "top_k")
    if p.seed is not None and (not _int(p.seed) or not SEED_RANGE[0] <= p.seed < SEED_RANGE[1]):
        raise _bad("seed must be an integer that fits in 64 bits", "seed")
    if isinstance(p.stop, str):
        p.stop = [p.stop]
    if not isinstance(p.stop, list) or not all(isinstance(s, str) for s in p.stop):
        raise _bad("stop must be a string or a list of strings", "stop")
    if len(p.stop) > WORKER_MAX_STOP_STRINGS:
        raise _bad(f"at most {WORKER_MAX_STOP_STRINGS} stop strings, got {len(p.stop)}", "stop")
    if any(len(s) > WORKER_MAX_STOP_CHARS for s in p.stop):
        raise _bad(f"a stop string may be at most {WORKER_MAX_STOP_CHARS} characters long", "stop")
    if not isinstance(p.stop_token_ids, list) or not all(is_token(t, vocab_size) for t in p.stop_token_ids):
        raise _bad(f"stop_token_ids must be token ids in [0, {vocab_size})", "stop_token_ids")
    if not isinstance(p.ignore_eos, bool):
        raise _bad("ignore_eos must be true or false", "ignore_eos")
    check_controls(p, vocab_size)


def tokenize(tokenizer: Any, req: GenerateRequest, vocab_size: int) -> list[int]:
    """The prompt's token ids, from exactly one of prompt, messages or prompt_token_ids."""
    given = [x is not None for x in (req.prompt, req.messages, req.prompt_token_ids)]
    if sum(given) != 1:
        raise RequestError("give exactly one of prompt, messages or prompt_token_ids", param="prompt")
    if req.prompt_token_ids is not None:
        ids = req.prompt_token_ids
        if not isinstance(ids, list) or not all(is_token(t, vocab_size) for t in ids):
            raise RequestError(f"prompt_token_ids must be a list of token ids in [0, {vocab_size})", param="prompt")
        return list(ids)
    if req.prompt is not None:
        if not isinstance(req.prompt, str):
            raise RequestError("prompt must be a string", param="prompt")
        try:
            return list(tokenizer(req.prompt)["input_ids"])
        except Exception as e:  # noqa: BLE001 - a tokenizer's refusal of one text fails that request
            raise RequestError(f"cannot tokenize the prompt: {e}", param="prompt") from e
    if not isinstance(req.messages, list) or not all(isinstance(m, dict) for m in req.messages):
        raise RequestError("messages must be a list of objects with role and content", param="messages")
    add_generation_prompt, continue_final, extra = template_args(req.chat_options)
    try:
        enc = tokenizer.apply_chat_template(req.messages, add_generation_prompt=add_generation_prompt and not
                                            continue_final, continue_final_message=continue_final,
                                            tokenize=True, return_dict=True, **extra)
    except Exception as e:  # noqa: BLE001 - template errors come in many types
        raise RequestError(f"cannot apply the chat template to messages: {e}", param="messages") from e
    return list(enc["input_ids"])


def generated_ids(req: GenerateRequest, vocab_size: int) -> list[int]:
    """generated_token_ids, or [first_token_id] (its older spelling), checked to be token ids."""
    resumed = [] if req.generated_token_ids is None else req.generated_token_ids
    if req.first_token_id is not None and isinstance(resumed, list) and not resumed:
        resumed = [req.first_token_id]
    if not isinstance(resumed, list) or not all(is_token(t, vocab_size) for t in resumed):
        raise RequestError("generated_token_ids must be token ids", param="generated_token_ids")
    if req.first_token_id is not None and resumed[0] != req.first_token_id:
        raise RequestError("first_token_id differs from generated_token_ids[0]", param="first_token_id")
    return list(resumed)


def check_flow(fairness_id: Any, priority: Any) -> tuple[str, int]:
    """GenerateRequest.fairness_id and priority: the sequence's flow for the scheduler ("" when none)."""
    if fairness_id is not None and (not isinstance(fairness_id, str) or len(fairness_id) > MAX_FAIRNESS_ID_CHARS):
        raise _bad(f"fairness_id must be a string of at most {MAX_FAIRNESS_ID_CHARS} characters", "fairness_id")
    if not isinstance(priority, int) or isinstance(priority, bool) or abs(priority) > 2**31:
        raise _bad("priority must be an integer between -2**31 and 2**31", "priority")
    return fairness_id or "", priority


def check_cache_salt(salt: Any) -> str | None:
    """GenerateRequest.cache_salt: None, or a non-empty string of at most MAX_CACHE_SALT_CHARS."""
    if salt is None:
        return None
    if not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT_CHARS:
        raise _bad(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
                   "cache_salt")
    return salt
