"""Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5): a short causal depthwise convolution
over q, k and v, then the gated delta rule, whose state per value head is a [Dk, Dv] matrix
that every token decays and corrects. Shapes: T tokens in the step, Hk key heads, Hv value
heads (a multiple of Hk: value head h reads key head h // (Hv / Hk)), Dk and Dv their sizes,
C = 2 Hk Dk + Hv Dv convolved channels, K the convolution's width.

A sequence's two states live in a slot of a state pool (one slot per running sequence, kv/
manager.py hands them out): the last K - 1 convolution inputs [C, K - 1] and the recurrent
state [Hv, Dk, Dv], float32 whatever the activations. A sequence whose step starts at position
0 starts from zeros; any later step (the next prefill chunk, a decode token) resumes from its
slot, and every step writes the slot back, so chunked prefill carries the state from chunk to
chunk, and preemption (the slot freed, the prompt computed again from position 0) restores it
by recomputing.

The delta rule per token t, as transformers' recurrent reference computes it:
    S <- exp(g_t) S;  d_t = beta_t (v_t - S^T k_t);  S <- S + k_t d_t^T;  o_t = S^T q_t
with q and k L2-normalised and q scaled by Dk^-1/2. A prefill runs it in chunks of 64 tokens
(the chunk form FLA and transformers use): within a chunk, with G_i the decay from the chunk's
start through token i and S0 the state before it, the corrections solve one unit lower
triangular system (I + T) d = beta v - diag(beta G) K S0, T_ij = beta_i (G_i / G_j) k_i . k_j
for j < i; the outputs and the next state are then two matrix products each."""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """FLA's and transformers' l2norm: x / sqrt(sum x^2 + eps) over the last dimension."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, previous: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, C] after previous [C, K - 1] (the inputs before x, zeros at a sequence's start),
    weight [C, K] -> (silu(depthwise causal convolution) [n, C], the last K - 1 inputs)."""
    width = weight.shape[1]
    full = torch.cat([previous.to(x.dtype), x.t()], dim=1)  # [C, K - 1 + n]
    out = F.conv1d(full.unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0])[0]  # [C, n]
    return F.silu(out).t(), full[:, full.shape[1] - (width - 1):]


def _per_value_head(q: torch.Tensor, k: torch.Tensor, ratio: int, tiled: bool):
    """q, k [..., Hk, Dk] -> [..., Hv, Dk], normalised (q also scaled by Dk^-1/2): each key
    head repeated for its value heads, grouped (h // ratio) or tiled (h % Hk)."""
    q, k = l2_normalize(q.float()), l2_normalize(k.float())
    q = q * q.shape[-1] ** -0.5
    if ratio > 1 and tiled:
        reps = [1] * (q.dim() - 2) + [ratio, 1]
        q, k = q.repeat(*reps), k.repeat(*reps)
    elif ratio > 1:
        q, k = q.repeat_interleave(ratio, dim=-2), k.repeat_interleave(ratio, dim=-2)
    return q, k


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, state: torch.Tensor, tiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens: q, k [n, Hk, Dk], v [n, Hv, Dv], g (log decay, <= 0) and beta
    [n, Hv], state [Hv, Dk, Dv] before them -> (outputs [n, Hv, Dv] float32, the state after).
    tiled: value head h reads key head h % Hk (else h // (Hv / Hk))."""
    n, hv = v.shape[0], v.shape[1]
    q, k = _per_value_head(q, k, hv // q.shape[1], tiled)
    q, k = q.transpose(0, 1), k.transpose(0, 1)
    v, g, beta = v.float().transpose(0, 1), g.float().t(), beta.float().t()  # [Hv, n, Dv], [Hv, n]
    state = state.float()
    out = torch.empty_like(v)
    for c0 in range(0, n, CHUNK):
        c1 = min(n, c0 + CHUNK)
        qc, kc, vc, bc = q[:, c0:c1], k[:, c0:c1], v[:, c0:c1], beta[:, c0:c1]
        decay = g[:, c0:c1].cumsum(dim=1)  # log G_i
        length = c1 - c0
        lower = torch.ones(length, length, dtype=torch.bool).tril()
        # G_i / G_j for j <= i, 0 above the diagonal (masked before exp: no overflow)
        pairwise = (decay.unsqueeze(2) - decay.unsqueeze(1)).masked_fill(~lower, float("-inf")).exp()
        kb = kc * bc.unsqueeze(-1)
        system = (kb @ kc.transpose(1, 2)) * pairwise  # T, read strictly below its diagonal
        rhs = torch.cat([vc * bc.unsqueeze(-1), kb * decay.exp().unsqueeze(-1)], dim=-1)
        solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        u, w = solved.split([vc.shape[-1], kc.shape[-1]], dim=-1)
        d = u - w @ state  # the corrections [Hv, L, Dv]
        scores = (qc @ kc.transpose(1, 2)) * pairwise
        out[:, c0:c1] = (qc * decay.exp().unsqueeze(-1)) @ state + scores @ d
        last = decay[:, -1:]  # log G_L
        state = state * last.exp().unsqueeze(-1) + (kc * (last - decay).exp().unsqueeze(-1)).transpose(1, 2) @ d
    return out.transpose(0, 1), state


def recurrent_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, state: torch.Tensor, tiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One token each of B sequences (decode): q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv],
    state [B, Hv, Dk, Dv] -> (outputs [B, Hv, Dv] float32, the states after), transformers'
    recurrent step."""
    state = state.float().clone()
    return recurrent_delta_rule_(q, k, v, g, beta, state, tiled), state


def recurrent_delta_rule_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor, state: torch.Tensor, tiled: bool = False) -> torch.Tensor:
    """recurrent_delta_rule on a float32 state [B, Hv, Dk, Dv] updated in place (a view of a
    slot of the state pool: no copy of the state in or out) -> outputs [B, Hv, Dv]. The sums
    over Dk as matrix products, and the rank-one update as one baddbmm_: three passes over the
    state where elementwise products took six, each with a state-sized temporary."""
    q, k = _per_value_head(q, k, v.shape[1] // q.shape[1], tiled)
    b, h, dk, dv = state.shape
    flat = state.view(b * h, dk, dv)
    flat.mul_(g.float().exp().reshape(b * h, 1, 1))
    remembered = torch.bmm(k.reshape(b * h, 1, dk), flat)  # S^T k [B Hv, 1, Dv]
    delta = (v.float().reshape(b * h, 1, dv) - remembered) * beta.float().reshape(b * h, 1, 1)
    flat.baddbmm_(k.reshape(b * h, dk, 1), delta)
    return torch.bmm(q.reshape(b * h, 1, dk), flat).view(b, h, dv)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3-Next's RMSNormGated over the last dimension: weight · norm(x), times silu(gate) in
    float32, in the activations' dtype."""
    dtype = gate.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return ((weight * xf.to(dtype)) * F.silu(gate.float())).to(dtype)
