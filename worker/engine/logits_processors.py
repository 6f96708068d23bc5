"""The logits processors a request can ask for, applied to a step's sampled rows in one pass each:
repetition, presence and frequency penalties, logit_bias, min_tokens (EOS and stop ids masked) and
the grammar's token mask (grammar.py). Each builds its tensors for the rows that use it only, so a
batch where nobody asks costs nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tandem.worker.engine.sampling import SampleRow


def _penalised(r: SampleRow) -> bool:
    p = r.params
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _min_tokens_left(r: SampleRow) -> bool:
    return r.params.min_tokens > r.index


def needs_processing(r: SampleRow) -> bool:
    return bool(_penalised(r) or r.params.logit_bias or _min_tokens_left(r) or r.grammar is not None)


def _counts(ids: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """How often each token occurs in each row's ids: [rows, vocab]."""
    width = max((len(x) for x in ids), default=0)
    padded = torch.full((len(ids), width + 1), vocab, dtype=torch.long, device=device)
    for i, x in enumerate(ids):
        if x:
            padded[i, : len(x)] = torch.tensor(x, dtype=torch.long, device=device)
    counts = torch.zeros(len(ids), vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab]


def _penalties(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    idx = [i for i, r in enumerate(rows) if _penalised(r)]
    if not idx:
        return
    dev, vocab = logits.device, logits.shape[1]
    ps = [rows[i].params for i in idx]
    x = logits[idx]
    out_counts = _counts([rows[i].output_ids for i in idx], vocab, dev)
    rep = torch.tensor([p.repetition_penalty for p in ps], device=dev).unsqueeze(1)
    if bool((rep != 1.0).any()):
        seen = (_counts([rows[i].prompt_ids for i in idx], vocab, dev) + out_counts) > 0
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    freq = torch.tensor([p.frequency_penalty for p in ps], device=dev).unsqueeze(1)
    pres = torch.tensor([p.presence_penalty for p in ps], device=dev).unsqueeze(1)
    x = x - freq * out_counts - pres * (out_counts > 0).float()
    logits[idx] = x


def _bias(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    row_idx: list[int] = []
    tok_idx: list[int] = []
    values: list[float] = []
    for i, r in enumerate(rows):
        for tok, b in r.params.logit_bias.items():
            row_idx.append(i)
            tok_idx.append(int(tok))
            values.append(float(b))
    if row_idx:
        dev = logits.device
        logits.index_put_((torch.tensor(row_idx, device=dev), torch.tensor(tok_idx, device=dev)),
                          torch.tensor(values, device=dev), accumulate=True)


def _min_tokens(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for i, r in enumerate(rows):
        if _min_tokens_left(r):
            banned = set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else set(r.eos_ids))
            row_idx += [i] * len(banned)
            tok_idx += sorted(banned)
    if row_idx:
        dev = logits.device
        logits[torch.tensor(row_idx, device=dev), torch.tensor(tok_idx, device=dev)] = float("-inf")


def _grammar(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    idx = [i for i, r in enumerate(rows) if r.grammar is not None]
    if not idx:
        return
    from tandem.worker.engine.grammar import allowed_tokens

    allowed = allowed_tokens([rows[i].grammar for i in idx], logits.shape[1]).to(logits.device)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))


def apply_processors(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Every processor the rows ask for, in place on float32 `logits` [rows, vocab]; returns it.
    The grammar's mask goes last: nothing after it can re-allow a token it forbids."""
    _penalties(logits, rows)
    _bias(logits, rows)
    _min_tokens(logits, rows)
    _grammar(logits, rows)
    return logits
