"""One step's index tensors, built once from its BatchItems and shared by every layer's paged
attention (hf/paged_attention.py) and the compiled decode step: token ids and positions,
the pool slot each token's K/V goes to, the rows to sample, and how each row attends (a single-token
row by block table, a longer chunk over its context)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tandem.worker.engine.decode_step import MIN_TABLE_WIDTH
from tandem.worker.engine.model_runner import BatchItem


@dataclass
class Chunk:
    offset: int  # first row in the flat batch
    num_tokens: int
    start: int  # position of its first token
    table: torch.Tensor | None  # its blocks, when it continues a sequence (start > 0)


@dataclass
class StepInputs:
    """The index tensors of one step, built once and shared by every layer."""

    ids: torch.Tensor
    positions: torch.Tensor
    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    sample_rows: list[int]
    decode_rows: list[int] = field(default_factory=list)  # rows of single-token items
    tables: torch.Tensor | None = None  # [decode rows, width]
    chunks: list[Chunk] = field(default_factory=list)

    @property
    def decode_only(self) -> bool:
        return not self.chunks


def step_inputs(items: list[BatchItem], block_size: int, device: torch.device) -> StepInputs:
    bs = block_size
    ids: list[int] = []
    pos: list[int] = []
    slot_blocks: list[int] = []
    sample_rows: list[int] = []
    decode_rows: list[int] = []
    decode_tables: list[list[int]] = []
    chunk_specs: list[tuple[int, int, int, list[int]]] = []
    for it in items:
        row, n = len(ids), len(it.token_ids)
        ids.extend(it.token_ids)
        if n == 1:
            p = it.start
            pos.append(p)
            slot_blocks.append(it.block_table[p // bs])
            decode_rows.append(row)
            decode_tables.append(it.block_table[: p // bs + 1])
        else:
            pos.extend(range(it.start, it.start + n))
            table = it.block_table
            slot_blocks.extend(table[p // bs] for p in range(it.start, it.start + n))
            chunk_specs.append((row, n, it.start, table[: (it.start + n - 1) // bs + 1]))
        if it.sample:
            sample_rows.append(row + n - 1)
    positions = torch.tensor(pos, dtype=torch.long, device=device)
    st = StepInputs(
        ids=torch.tensor(ids, dtype=torch.long, device=device), positions=positions,
        slot_blocks=torch.tensor(slot_blocks, dtype=torch.long, device=device),
        slot_offsets=positions % bs, sample_rows=sample_rows, decode_rows=decode_rows)
    if decode_tables:
        width = max(MIN_TABLE_WIDTH, max(len(t) for t in decode_tables))
        st.tables = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables], dtype=torch.long, device=device)
    st.chunks = [Chunk(row, n, start, torch.tensor(table, dtype=torch.long, device=device) if start else None)
                 for row, n, start, table in chunk_specs]
    return st
