import torch
import torch.nn.functional as F

from pyserve import _native


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2d] holding [gate | up] -> silu(gate) * up, [..., d]."""
    d = x.shape[-1] // 2
    if x.is_cpu and x.is_contiguous():
        out = x.new_empty(*x.shape[:-1], d)
        _native.silu_and_mul(out, x)
        return out
    return F.silu(x[..., :d]) * x[..., d:]
