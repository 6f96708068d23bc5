"""A tenant's `cache_salt` (vLLM's name; issue 21 defect 13) goes from the client through the router to
every worker of the request, so the prefix cache is no timing side channel between tenants: through
a real disaggregated stack, a prompt cached under one salt is found again only under that salt, the
text never depends on it, and a malformed salt is a 400 naming the field. The router's prefix index
names a salted prompt's blocks as the workers do."""

from __future__ import annotations

import time

import openai
import pytest
from tandem.contracts.prefix import block_hashes, request_salt
from tandem.router.journey import request_info
from tandem.router.openai_schema import Endpoint
from tandem.router.validation import Limits, parse_request
from tandem.testing.local_stack import LocalStack
from tandem.testing.scraped import scrape, value

HIT = "tandem_worker_prefix_cache_hit_tokens_total"


def cached_tokens_found(stack: LocalStack) -> float:
    """Prompt tokens every worker of the stack found in its prefix cache so far."""
    return sum(value(scrape(w["url"] + "/metrics"), HIT) for w in stack.workers())


def test_the_router_sends_the_salt_and_names_salted_blocks_as_the_workers_do():
    body = {"model": "m", "prompt": list(range(5, 69)), "cache_salt": "tenant-a"}
    req = parse_request(body, Endpoint.COMPLETION, Limits())
    assert req.cache_salt == "tenant-a"
    info = request_info(req, "r1")
    assert info.block_hashes(16, b"model") == block_hashes(body["prompt"], 16, request_salt(b"model", "tenant-a"))
    assert info.block_hashes(16, b"model") != block_hashes(body["prompt"], 16, b"model")
    unsalted = request_info(parse_request(body | {"cache_salt": None}, Endpoint.COMPLETION, Limits()), "r2")
    assert unsalted.block_hashes(16, b"model") == block_hashes(body["prompt"], 16, b"model")


@pytest.mark.e2e
@pytest.mark.slow
def test_a_prompt_cached_under_one_salt_is_found_only_under_it(disagg_stack, client, model_name):
    prompt = f"Tenant isolation check {time.monotonic_ns()}: " + "the prefix cache is shared by request. " * 12

    def complete(salt: str | None) -> tuple[str, float]:
        before = cached_tokens_found(disagg_stack)
        extra = {"cache_salt": salt} if salt is not None else {}
        r = client.completions.create(model=model_name, prompt=prompt, max_tokens=4, temperature=0,
                                      extra_body=extra)
        return r.choices[0].text, cached_tokens_found(disagg_stack) - before

    text, found = complete("tenant-a")
    assert found == 0
    assert complete("tenant-b") == (text, 0), "another tenant's salt finds nothing cached"
    assert complete(None) == (text, 0), "an unsalted request finds nothing salted"
    again, found = complete("tenant-a")
    assert again == text and found > 0, "the same tenant reuses its own blocks"


@pytest.mark.e2e
@pytest.mark.parametrize("salt", ["", "x" * 257, 7])
def test_a_malformed_salt_is_a_400_naming_it(client, model_name, salt):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt="hi", max_tokens=1, extra_body={"cache_salt": salt})
    assert e.value.body["param"] == "cache_salt" and "cache_salt" in e.value.body["message"]
