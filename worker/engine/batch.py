"""One step's forward pass and sampling (the runner stage of the step pipeline,
output_processor.py), with a failure kept to the sequences that caused it.

A batch shares its forward pass and its sampling call, so one sequence whose input breaks them
would fail every sequence beside it. When the forward pass raises, the batch runs again in halves
(writing the same K/V into the same slots, so a retry changes nothing) until the failing items are
alone; when sampling raises, each row is sampled on its own. What fails is the result of those
items only; the rest of the batch goes on. A fault of the device itself fails every half the same
way, and so every sequence of the batch, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from tandem.worker.engine.model_runner import BatchItem, ModelRunner
from tandem.worker.engine.output_processor import Sampled
from tandem.worker.engine.sampling import SampleRow, sample_batch
from tandem.worker.engine.scheduler import ScheduledChunk

log = logging.getLogger("tandem.worker.engine")

# For each chunk: the sampled token and its logprobs, None when the chunk samples nothing, or what failed it.
Result = Sampled | None | Exception


def run_batch(runner: ModelRunner, chunks: Sequence[ScheduledChunk], items: Sequence[BatchItem]) -> list[Result]:
    """Forward pass and sampling for `chunks` (their `items`); never raises."""
    try:
        out = runner.forward(list(items))
    except Exception as e:  # noqa: BLE001 - kept to the items that cause it, below
        if len(items) == 1:
            log.warning("forward pass failed for %s: %s", chunks[0].seq.request_id, e)
            return [e]
        half = len(items) // 2
        log.warning("forward pass of %d sequences failed (%s): running them in halves to find the cause",
                    len(items), e)
        return run_batch(runner, chunks[:half], items[:half]) + run_batch(runner, chunks[half:], items[half:])
    rows = [i for i, c in enumerate(chunks) if c.sample]
    results: list[Result] = [None] * len(chunks)
    for i, tok in zip(rows, sample_rows(out.logits, out.argmax, [chunks[i] for i in rows]), strict=True):
        results[i] = tok
    return results


def _row(c: ScheduledChunk) -> SampleRow:
    seq = c.seq
    return SampleRow(seq.params, seq.seed, len(seq.output_ids), seq.prompt_ids, seq.output_ids, seq.eos_ids,
                     seq.grammar)


def _sample(logits: Any, argmax: Any, chunks: list[ScheduledChunk]) -> list[Sampled]:
    """The token of each of `chunks`, with its logprobs where its request asked."""
    tokens, logprobs = sample_batch(logits, [_row(c) for c in chunks], argmax)
    return [Sampled(tok, lp) for tok, lp in zip(tokens, logprobs, strict=True)]


def sample_rows(logits: Any, argmax: Any, chunks: list[ScheduledChunk]) -> list[Sampled | Exception]:
    """The next token of each sampled chunk; a row whose sampling raises gets its exception."""
    if not chunks:
        return []
    try:
        return list(_sample(logits, argmax, chunks))
    except Exception as e:  # noqa: BLE001 - find the row that raised, below
        log.warning("sampling %d rows failed (%s): sampling each row alone", len(chunks), e)
    out: list[Sampled | Exception] = []
    for i in range(len(chunks)):
        try:
            row_argmax = None if argmax is None else argmax[i : i + 1]
            out.append(_sample(logits[i : i + 1], row_argmax, chunks[i : i + 1])[0])
        except Exception as e:  # noqa: BLE001 - this row's failure is this sequence's alone
            out.append(e)
    return out
