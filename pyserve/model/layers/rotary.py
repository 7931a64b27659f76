"""Rotary position embedding, neox style (rotate halves), with Llama 3, linear or YaRN frequency
scaling (or a GGUF's per-frequency divisors, rope_freqs).

cos/sin are tabulated once in float32 for every position up to the model length; the
inverse frequencies are computed exactly as Hugging Face computes them so float32 output
matches it bit for bit."""

from __future__ import annotations

import math

import torch
from torch import nn

from pyserve import _native


def _inv_freq(head_dim: int, base: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim
    return 1.0 / (base ** exponents)


def _llama3_scaled(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_scaled(head_dim: int, base: float, s: dict) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as transformers computes it: each frequency between
    interpolated (divided by the factor) and kept, by a linear ramp over the dimensions whose
    wavelength fits beta_fast to beta_slow times in the original context; and the attention
    factor that scales cos and sin."""
    factor = float(s["factor"])
    original = float(s["original_max_position_embeddings"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def dimension(rotations: float) -> float:  # the dimension that turns `rotations` times
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension(beta_fast), dimension(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    kept = 1 - ramp  # how much of each frequency stays as it is (extrapolated)
    powers = base ** (torch.arange(0, head_dim, 2).to(dtype=torch.float) / head_dim)
    inv_freq = (1.0 / (factor * powers)) * (1 - kept) + (1.0 / powers) * kept
    return inv_freq, float(attention)


def llama3_factors(head_dim: int, base: float, scaling: dict) -> torch.Tensor:
    """What Llama 3 scaling divides each inverse frequency by: llama.cpp writes these as the
    GGUF tensor rope_freqs.weight instead of the scaling's parameters."""
    inv_freq = _inv_freq(head_dim, base).double()
    return inv_freq / _llama3_scaled(inv_freq, scaling)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, base: float, scaling: dict | None):
        super().__init__()
        inv_freq = _inv_freq(head_dim, base)
        attention = 1.0  # what cos and sin are scaled by (YaRN's attention factor)
        if scaling is not None:
            kind = scaling.get("rope_type")
            if kind == "yarn":
                inv_freq, attention = _yarn_scaled(head_dim, base, scaling)
            elif kind == "llama3":
                inv_freq = _llama3_scaled(inv_freq, scaling)
            elif kind == "linear":  # positions divided by the factor (Gemma 3's global layers)
                inv_freq = inv_freq / float(scaling["factor"])
            elif kind == "rope_freqs":  # a GGUF's per-frequency divisors, as llama.cpp applies them
                inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
            else:
                raise ValueError(f"rope scaling '{kind}' is not supported (supported: llama3, "
                                 "linear, yarn)")
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        if attention != 1.0:
            cos, sin = cos * attention, sin * attention
        self.register_buffer("cos", cos, persistent=False)  # [max_positions, head_dim/2]
        self.register_buffer("sin", sin, persistent=False)
        # the native kernel's table: [max_positions, head_dim] = cat(cos, sin)
        self.register_buffer("cos_sin", torch.cat((self.cos, self.sin), dim=-1), persistent=False)
        self.head_dim = head_dim

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hkv, D] -> rotated (in place on the CPU, else copies)."""
        if q.is_cpu and q.dtype == torch.float32:
            _native.rotary_embedding(positions, q, k, self.head_dim, self.cos_sin, True)
            return q, k
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class InterleavedRotary(nn.Module):
    """GPT-J's layout (GLM-4, ERNIE 4.5): pairs of dimensions (2i, 2i+1) turned by frequency i,
    over the first `share` of each head, the rest passed through; the operations transformers'
    code for them runs, in its order."""

    def __init__(self, head_dim: int, share: float, max_positions: int, base: float,
                 scaling: dict | None):
        super().__init__()
        self.dim = int(head_dim * share)
        table = RotaryEmbedding(self.dim, max_positions, base, scaling)  # [positions, dim / 2]
        self.register_buffer("cos", table.cos, persistent=False)
        self.register_buffer("sin", table.sin, persistent=False)

    def _turn(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        turned, passed = x[..., :self.dim], x[..., self.dim:]
        pairs = torch.stack((-turned[..., 1::2], turned[..., 0::2]), dim=-1).flatten(-2)
        return torch.cat([turned * cos + pairs * sin, passed], dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hkv, D] -> rotated copies."""
        cos = self.cos[positions].repeat_interleave(2, dim=-1).unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].repeat_interleave(2, dim=-1).unsqueeze(1).to(q.dtype)
        return self._turn(q, cos, sin), self._turn(k, cos, sin)
