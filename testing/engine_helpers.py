"""Small helpers for driving a tandem Engine from tests and benchmarks (no HTTP)."""

from __future__ import annotations

from typing import Any

from tandem.worker.protocol import GenerateRequest, SamplingParams


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=kw.pop("ignore_eos", True), **kw)


def submit(engine: Any, request_id: str, prompt_ids: list[int], params: SamplingParams) -> list[Any]:
    """Add a request to a (synchronous) Engine; returns the list its outputs are appended to."""
    outs: list[Any] = []
    seq = engine.make_sequence(GenerateRequest(request_id=request_id, prompt_token_ids=prompt_ids, sampling=params))
    seq.sink = outs.append
    engine.add(seq)
    return outs


def run_to_completion(engine: Any, max_steps: int = 10_000) -> int:
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        if steps > max_steps:
            raise RuntimeError("engine did not finish")
    return steps


def tokens_of(outs: list[Any]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def text_of(outs: list[Any]) -> str:
    return "".join(o.text for o in outs)
