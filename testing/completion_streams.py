"""Concurrent streaming completions through a router, one thread each, for tests that disturb the
workers while tokens flow (SIGTERM, scale-down): the text, chunks and finish reason of each, and
any error, under one condition variable a test can wait on."""

from __future__ import annotations

import threading
from collections.abc import Callable

import openai


class CompletionStreams:
    """One greedy `ignore_eos` stream per prompt, started at once."""

    def __init__(self, url: str, model: str, prompts: list[str], max_tokens: int, timeout_s: float = 300) -> None:
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=timeout_s)
        self.model, self.prompts, self.max_tokens = model, prompts, max_tokens
        n = len(prompts)
        self.texts, self.chunks = [""] * n, [0] * n
        self.ids: list[str | None] = [None] * n  # each completion's id: "cmpl-" + the router's request id
        self.finish: list[str | None] = [None] * n
        self.errors: list[str] = []
        self.changed = threading.Condition()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        try:
            for chunk in self.client.completions.create(model=self.model, prompt=self.prompts[i],
                                                        max_tokens=self.max_tokens, temperature=0, stream=True,
                                                        extra_body={"ignore_eos": True}):
                with self.changed:
                    self.ids[i] = chunk.id
                    for c in chunk.choices:
                        self.texts[i] += c.text or ""
                        self.finish[i] = c.finish_reason or self.finish[i]
                    self.chunks[i] += 1
                    self.changed.notify_all()
        except Exception as e:  # noqa: BLE001 - reported by the test
            with self.changed:
                self.errors.append(f"stream {i}: {e!r}")
                self.changed.notify_all()

    def wait(self, predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Until predicate() holds (or a stream failed); raises AssertionError on a timeout or an error."""
        with self.changed:
            if not self.changed.wait_for(lambda: predicate() or self.errors, timeout_s):
                raise AssertionError(f"timed out waiting for {what}: chunks {self.chunks}")
        assert not self.errors, self.errors[:5]

    def join(self, timeout_s: float = 120.0) -> None:
        """Every stream ended: none still running, none with an error, each stopped by max_tokens."""
        for t in self.threads:
            t.join(timeout_s)
            assert not t.is_alive(), "a stream did not end"
        assert not self.errors, self.errors[:5]
        assert all(f == "length" for f in self.finish), self.finish


def undisturbed(url: str, model: str, prompts: list[str], max_tokens: int, timeout_s: float = 300) -> list[str]:
    """The text of each prompt from a plain (non-streaming) greedy run, to compare streams with."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=timeout_s)
    return [client.completions.create(model=model, prompt=p, max_tokens=max_tokens, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
