"""Local stacks (`tandem up` on loopback with the toy model), started once per mode per session."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from tandem.testing.local_stack import LocalStack

# Prompts estimated under 8 tokens (32 characters) skip prefill on the disaggregated stack, so
# both routes are exercised; the tests' "long" prompts are well above that.
SHORT_PROMPT_THRESHOLD = 8
MAX_PROMPT_TOKENS = 1500


@pytest.fixture(scope="session")
def disagg_stack(toy_model_dir: Path):
    stack = LocalStack(
        toy_model_dir, "disaggregated",
        ["--kv-backend", "tcp", "--short-prompt-threshold", str(SHORT_PROMPT_THRESHOLD),
         f"--router-arg=--max-prompt-tokens={MAX_PROMPT_TOKENS}"],
    )
    with stack:
        yield stack


@pytest.fixture(scope="session")
def colocated_stack(toy_model_dir: Path):
    with LocalStack(toy_model_dir, "colocated") as stack:
        yield stack


def _client(stack: LocalStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def client(disagg_stack: LocalStack) -> openai.OpenAI:
    """The official client against the disaggregated stack."""
    return _client(disagg_stack)


@pytest.fixture
def colocated_client(colocated_stack: LocalStack) -> openai.OpenAI:
    return _client(colocated_stack)


@pytest.fixture
def model_name(toy_model_dir: Path) -> str:
    return toy_model_dir.name
