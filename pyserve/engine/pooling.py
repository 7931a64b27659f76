"""The engine's half of pooling: a pooling request's state while its prompt is computed.

A pooling request is a prompt with no output: the scheduler schedules its prompt under the
same budget and in the same batches as generation (chunked when it is long, unless the model
attends in both directions, where the whole prompt must be in one step), the runner reduces
each chunk's hidden-state rows (model/pooler.py), and this state combines the chunks. When
the last prompt token is computed the request ends at once: it never samples, and its KV
blocks go back (a causal model's full blocks stay in the prefix cache for later requests).

Pooling over a prefix the cache already holds needs only the rows it computes: LAST does
(its last row is always computed); MEAN, CLS and ALL read every row, so they bypass the
cache. A preempted request restarts from its first token, and so does its state."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pyserve.errors import InvalidRequest
from pyserve.pooling_params import ModelPooler, PoolingParams


class PoolingState:
    def __init__(self, pooling_type: str, normalize: bool, dimensions: int | None,
                 whole_prompt: bool):
        self.pooling_type = pooling_type  # LAST | MEAN | CLS | ALL
        self.normalize = normalize
        self.dimensions = dimensions
        self.whole_prompt = whole_prompt  # bidirectional attention: one step, never chunked
        self._total: torch.Tensor | None = None  # LAST, CLS: the row; MEAN: the rows' sum
        self._rows: list[torch.Tensor] = []  # ALL

    @property
    def cacheable(self) -> bool:
        """A cached prefix may serve it (it reads no row of the prefix)."""
        return self.pooling_type == "LAST" and not self.whole_prompt

    def restart(self) -> None:
        self._total, self._rows = None, []

    def add(self, part: torch.Tensor | None) -> None:
        if part is None:
            return
        if self.pooling_type == "ALL":
            self._rows.append(part)
        elif self.pooling_type == "MEAN" and self._total is not None:
            self._total = self._total + part
        else:
            self._total = part

    def result(self, num_tokens: int) -> torch.Tensor:
        """The pooled output, float32: [hidden] (or [tokens, hidden] for ALL), cut to the
        requested dimensions and L2-normalised when asked."""
        if self.pooling_type == "ALL":
            out = torch.cat(self._rows)
        else:
            out = self._total / num_tokens if self.pooling_type == "MEAN" else self._total
        if self.dimensions is not None:
            out = out[..., : self.dimensions]
        if self.normalize:
            out = F.normalize(out, p=2, dim=-1)
        return out.contiguous()


def pooling_state(params: PoolingParams, pooler: ModelPooler, hidden_size: int,
                  whole_prompt: bool) -> PoolingState:
    """The state a request starts with, or InvalidRequest naming the field it cannot have."""
    if params.dimensions is not None:
        allowed = pooler.matryoshka_dimensions
        if allowed is None:
            raise InvalidRequest("dimensions", "Model does not support matryoshka representation, "
                                 "changing output dimensions will lead to poor results.")
        if params.dimensions > hidden_size or (allowed and params.dimensions not in allowed):
            sizes = ", ".join(map(str, allowed)) if allowed else f"1 to {hidden_size}"
            raise InvalidRequest("dimensions", f"dimensions {params.dimensions} is not one this "
                                 f"model supports ({sizes})")
    kind = "ALL" if params.task == "token_embed" else pooler.pooling_type
    normalize = pooler.normalize if params.normalize is None else params.normalize
    return PoolingState(kind, normalize, params.dimensions, whole_prompt)
