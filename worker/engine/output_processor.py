"""The step pipeline's last stage (issue 30 item 3). A step goes:

  scheduler.py  what each item of the batch is: a prefill chunk or a decode (ScheduledChunk.prefill)
  batch.py      the runner: the forward pass and sampling, a token and its logprobs per sampled row
                (`Sampled`), a failure bisected down to the sequence that caused it
  here          the output processor: a sampled token taken into its sequence, the stop rules
                applied, the text detokenized; what goes to the request (SeqOutput)

It writes no state: it says why a token ends its sequence and the engine moves the sequence through
the request table (request_table.py). Tokens generated elsewhere (a resumed request) are taken the
same way before the sequence runs (intake.py), so it continues from the state they left.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from tandem.contracts.protocol import FinishReason
from tandem.worker.engine.sequence import EngineSequence, SeqOutput

log = logging.getLogger("tandem.worker.engine")


class Sampled(NamedTuple):
    """What the runner sampled for one row."""

    token: int
    logprobs: Any = None  # its TokenLogprobs, when the request asked


def append_token(seq: EngineSequence, tok: int) -> FinishReason | None:
    """Take `tok` into the sequence (the detokenizer and the grammar see it too); why it ends the
    sequence, else None. The text it completes waits in seq.detok for take_output or final_text."""
    seq.output_ids.append(tok)
    p = seq.params
    if (tok in seq.eos_ids and not p.ignore_eos) or tok in seq.stop_ids or seq.detok.add(tok):
        return FinishReason.STOP
    if seq.grammar is not None and seq.grammar.accept(tok):
        return FinishReason.STOP
    if len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= seq.max_total_len:
        return FinishReason.LENGTH
    return None


def take_output(seq: EngineSequence, sampled: Sampled) -> tuple[SeqOutput, FinishReason | None]:
    """A sampled token made into the request's output: its id, logprobs and text (all the text
    held back, when it ends the sequence), and why it ends it, if it does."""
    reason = append_token(seq, sampled.token)
    out = SeqOutput(seq.request_id, token_ids=[sampled.token],
                    logprobs=None if sampled.logprobs is None else [sampled.logprobs])
    out.text = seq.detok.take(final=reason is not None)
    if reason is not None:
        out.finished, out.finish_reason = True, reason
    return out, reason


def final_text(seq: EngineSequence) -> str:
    """The text the detokenizer still holds back, or "" when it is what failed."""
    try:
        return seq.detok.take(final=True)
    except Exception:  # noqa: BLE001 - the sequence ends either way
        log.exception("could not detokenize the end of the text", extra={"request_id": seq.request_id})
        return ""
