"""The runner's half of pooling: a pooling sequence's hidden-state rows of one step reduced to
what the engine keeps (pyserve/step.py's PooledChunk). The hidden states are the model's
final-norm output, as vLLM pools a causal LM converted to an embedding model (and the last
layer's output for an encoder).

A prompt may arrive in chunks over several steps (chunked prefill), so each chunk yields a
part the engine combines: MEAN the rows' sum (the engine divides by the prompt length at the
end), LAST the last chunk's last row, CLS the first chunk's first row, ALL every row.
Sums are in float32 whatever the activation dtype."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pyserve.step import PooledChunk, PoolingInputs


@dataclass
class PoolingRows:
    """Where a pooling sequence's rows sit in the step's hidden states."""

    request_id: str
    start: int  # first row
    stop: int  # one past its last row
    inputs: PoolingInputs


def pool_chunk(hidden: torch.Tensor, rows: PoolingRows) -> torch.Tensor | None:
    """hidden [T, H] -> this sequence's part, on hidden's device; None if it contributes none."""
    kind, chunk = rows.inputs.pooling_type, hidden[rows.start: rows.stop]
    if kind == "LAST":
        return chunk[-1].float() if rows.inputs.last_chunk else None
    if kind == "CLS":
        return chunk[0].float() if rows.inputs.first_chunk else None
    if kind == "MEAN":
        return chunk.float().sum(dim=0)
    if kind == "ALL":
        return chunk.float()
    raise ValueError(f"unknown pooling type {kind!r}")


def pool_step(hidden: torch.Tensor, sequences: list[PoolingRows]) -> list[PooledChunk]:
    """Every pooling sequence's part of the step, copied to the CPU."""
    pooled = []
    for rows in sequences:
        part = pool_chunk(hidden, rows)
        pooled.append(PooledChunk(rows.request_id, None if part is None else part.cpu()))
    return pooled
