"""A step is a pipeline (issue 30, item 3): the scheduler says what each item is, the runner
(batch.py) runs the model and samples, returning a token and its logprobs per sampled row and
touching no sequence, and the output processor (output_processor.py) alone takes a token into its
sequence: the stop rules, the detokenizer, the request's output. A test of each stage on a real
engine, and a scan that fails on a token taken anywhere else."""

from __future__ import annotations

import ast
from pathlib import Path

from tandem.contracts.protocol import FinishReason
from tandem.testing.engine_helpers import greedy, run_to_completion, submit
from tandem.worker.engine.batch import run_batch
from tandem.worker.engine.output_processor import Sampled, take_output

ROOT = Path(__file__).resolve().parents[3]
SOURCES = ("worker", "router", "operator", "contracts", "planning", "testing", "cli", "bench")
THE_PROCESSOR = ROOT / "worker" / "engine" / "output_processor.py"


def _takes_a_token(tree: ast.AST) -> list[int]:
    """Lines that change a sequence's output_ids (append, extend, insert, +=, assignment) or feed
    its detokenizer (`.detok.add`)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if (isinstance(owner, ast.Attribute) and owner.attr == "output_ids"
                    and node.func.attr in ("append", "extend", "insert")):
                lines.append(node.lineno)
            if isinstance(owner, ast.Attribute) and owner.attr == "detok" and node.func.attr == "add":
                lines.append(node.lineno)
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AugAssign) else []
        lines += [node.lineno for t in targets if isinstance(t, ast.Attribute) and t.attr == "output_ids"]
    return lines


def test_only_the_output_processor_takes_a_token_into_a_sequence() -> None:
    found = {}
    for top in SOURCES:
        for path in (ROOT / top).rglob("*.py"):
            if path == THE_PROCESSOR or "out" in path.relative_to(ROOT).parts[1:2]:
                continue
            lines = _takes_a_token(ast.parse(path.read_text(), str(path)))
            if lines:
                found[str(path.relative_to(ROOT))] = lines
    assert not found, f"a token taken outside output_processor.py: {found}"
    assert _takes_a_token(ast.parse(THE_PROCESSOR.read_text())), "the scan finds nothing: it is broken"


def _scheduled(engine, prompt, params):
    outs = submit(engine, "r", prompt, params)
    chunks = engine.scheduler.schedule()
    return outs, chunks, [c.batch_item() for c in chunks]


def test_the_runner_returns_tokens_and_logprobs_and_leaves_the_sequence_alone(make_engine) -> None:
    engine = make_engine()
    prompt = list(range(5, 25))
    outs, chunks, items = _scheduled(engine, prompt, greedy(4, logprobs=2))
    [chunk] = chunks
    assert chunk.prefill and chunk.sample, "the scheduler says what the item is: a prompt that samples"
    [result] = run_batch(engine.runner, chunks, items)
    assert isinstance(result, Sampled) and isinstance(result.token, int)
    assert result.logprobs is not None and result.logprobs.token_id == result.token and len(result.logprobs.top) == 2
    assert chunk.seq.output_ids == [] and chunk.seq.detok.take() == "", "the runner took the token itself"

    out, reason = take_output(chunk.seq, result)
    assert chunk.seq.output_ids == [result.token] and out.token_ids == [result.token]
    assert out.logprobs == [result.logprobs] and reason is None and not out.finished
    assert engine.abort("r") and outs[-1].finished and outs[-1].finish_reason is FinishReason.ABORT


def test_the_output_processor_ends_a_sequence_and_returns_the_text_held_back(make_engine, loaded_toy) -> None:
    engine = make_engine()
    tok = loaded_toy.tokenizer
    prompt = tok.encode("the cat sat on the mat and")
    free = submit(engine, "free", prompt, greedy(6))
    run_to_completion(engine)
    text = "".join(o.text for o in free)
    stop = text[2:4]
    assert stop, f"the toy model's text is too short to stop in: {text!r}"

    stopped = submit(engine, "stopped", prompt, greedy(6, stop=[stop]))
    run_to_completion(engine)
    assert stopped[-1].finished and stopped[-1].finish_reason is FinishReason.STOP
    assert "".join(o.text for o in stopped) == text[:text.index(stop)]
