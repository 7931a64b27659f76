"""Pooling (embeddings): the server's --pooler-config, the pooling a model was resolved to at
start-up, and what one request asks for (vLLM's PoolingParams)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from pyserve.errors import InvalidRequest

POOLING_TYPES = ("LAST", "MEAN", "CLS")
TASKS = ("embed", "token_embed")  # one vector per input, or one per input token


@dataclass(frozen=True)
class PoolerConfig:
    """vLLM's --pooler-config JSON: what it gives overrides the model's own pooling."""

    pooling_type: str | None = None
    normalize: bool | None = None

    @staticmethod
    def from_json(text: str) -> "PoolerConfig":
        """ValueError saying what is wrong with the JSON."""
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--pooler-config is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError("--pooler-config must be a JSON object")
        unknown = sorted(set(data) - {"pooling_type", "normalize"})
        if unknown:
            raise ValueError(f"--pooler-config: unsupported key(s) {', '.join(unknown)}; "
                             "pyserve reads pooling_type and normalize")
        kind = data.get("pooling_type")
        if kind is not None and (not isinstance(kind, str) or kind.upper() not in POOLING_TYPES):
            raise ValueError(f"--pooler-config: pooling_type must be one of "
                             f"{', '.join(POOLING_TYPES)}, got {kind!r}")
        normalize = data.get("normalize")
        if normalize is not None and not isinstance(normalize, bool):
            raise ValueError("--pooler-config: normalize must be true or false")
        return PoolerConfig(kind.upper() if kind else None, normalize)


@dataclass(frozen=True)
class ModelPooler:
    """How this model pools unless a request says otherwise (resolved at start-up)."""

    pooling_type: str  # one of POOLING_TYPES
    normalize: bool
    # Matryoshka: the embedding may be cut to its first `dimensions` values. None: it may not;
    # () any size; otherwise the sizes it was trained for
    matryoshka_dimensions: tuple[int, ...] | None = None


@dataclass(frozen=True)
class PoolingParams:
    """One pooling request: task "embed" (one vector, pooled as the model pools) or
    "token_embed" (the hidden state of every token); normalize None: the model's default;
    dimensions: a Matryoshka cut, made before normalising."""

    task: str = "embed"
    normalize: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise InvalidRequest("task", f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool)
                                            or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise InvalidRequest("dimensions", "dimensions must be a positive integer")
