"""Greedy output through prefill -> KV handoff -> decode equals the colocated worker's, token for token."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = [
    "Once upon a time there was a little model that wanted to speak every language.",
    "Kubernetes schedules pods onto nodes, and an operator reconciles what it observes. " * 6,
    "Café, naïve, über, smörgåsbord, 東京, こんにちは, and emoji like 🚀 are UTF-8 too.",
]


@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "multi-block", "utf8"])
def test_greedy_completions_match(client, colocated_client, model_name, prompt):
    kw = dict(model=model_name, prompt=prompt, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    d = client.completions.create(**kw)
    c = colocated_client.completions.create(**kw)
    assert d.usage.prompt_tokens == c.usage.prompt_tokens
    assert d.usage.completion_tokens == c.usage.completion_tokens == 40
    assert d.choices[0].text == c.choices[0].text


def test_greedy_chat_streams_match(client, colocated_client, model_name):
    kw = dict(model=model_name, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=30,
              temperature=0, stream=True, stream_options={"include_usage": True},
              extra_body={"ignore_eos": True})
    d = list(client.chat.completions.create(**kw))
    c = list(colocated_client.chat.completions.create(**kw))

    def text(chunks):
        return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)

    assert text(d) == text(c) and text(d)
    assert d[-1].usage.completion_tokens == c[-1].usage.completion_tokens == 30
