"""The router limits an InferenceService renders (issue 28 item 4): max_tokens defaults to 4096 (or
the context - 1 when smaller) instead of the whole context, and one request's n x max_tokens and its
log probabilities are bounded by default and settable in router.limits; the router reads them all."""

from __future__ import annotations

import yaml
from tandem.contracts import request_limits
from tandem.operator import render
from tandem.router.config import load_yaml


def _router_config(tmp_path, model_len: int, limits: dict | None = None):
    spec = {"model": {"maxModelLen": model_len}, "router": {"limits": limits or {}}}
    f = tmp_path / "router.yaml"
    f.write_text(yaml.safe_dump(render.router_config("svc", "ns", spec)))
    return load_yaml(f)


def test_max_tokens_defaults_to_4096_not_the_whole_context(tmp_path):
    assert _router_config(tmp_path, 32768).max_tokens_limit == request_limits.MAX_OUTPUT_TOKENS == 4096
    assert _router_config(tmp_path, 2048).max_tokens_limit == 2047
    assert _router_config(tmp_path, 32768, {"maxOutputTokens": 8000}).max_tokens_limit == 8000


def test_one_requests_budget_has_defaults_and_can_be_set(tmp_path):
    c = _router_config(tmp_path, 4096)
    assert (c.max_request_output_tokens, c.max_request_logprobs) == (65536, 131072)
    c = _router_config(tmp_path, 4096, {"maxRequestOutputTokens": 1000, "maxRequestLogprobs": 5000})
    assert (c.max_request_output_tokens, c.max_request_logprobs) == (1000, 5000)
