import torch
from torch import nn

from pyserve import _native


class RMSNorm(nn.Module):
    """RMSNorm with the residual add fused in: forward(x, residual) returns
    (norm(x + residual), x + residual). Computed in float32 as Hugging Face does, so that
    float32 models match it bit for bit."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.is_cpu and x.is_contiguous():  # one native call instead of eight tensor ops
            if residual is None:
                out = torch.empty_like(x)
                _native.rms_norm(out, x, self.weight, self.eps)
                return out
            _native.fused_add_rms_norm(x, residual, self.weight, self.eps)  # both in place
            return x, residual
        if residual is None:
            return self._norm(x)
        x = residual + x
        return self._norm(x), x


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored as an offset from one, out = to_dtype(x_normed *
    (1 + weight)) with the product in float32 (transformers' Gemma 2/3 order: multiply, then
    round, where Llama rounds first). No fused residual: Gemma normalises a sublayer's output
    before adding it."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)
        # 1 + weight in float32, computed once the weights are in (weights_loaded): computed
        # per call (six norms a layer), it was about a quarter of the torch-op time of a Gemma 3
        # 270M decode step
        self.frozen_scale: torch.Tensor | None = None

    def weights_loaded(self) -> None:
        """load_model calls this once every weight is in place; later writes to the weight
        must call it again."""
        self.frozen_scale = 1.0 + self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.frozen_scale if self.frozen_scale is not None else 1.0 + self.weight.float()
        if x.dtype == torch.float32:
            # float32: the native order is transformers' order; q and k (views of the qkv
            # output) are copied contiguous first, as the native decoder layer does
            x = x.contiguous()
            out = torch.empty_like(x)
            _native.rms_norm(out, x, scale, self.eps)
            return out
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * scale).to(x.dtype)
