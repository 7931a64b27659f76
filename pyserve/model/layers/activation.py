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


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2d] holding [gate | up] -> gelu_tanh(gate) * up, [..., d] (Gemma's MLP)."""
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]
