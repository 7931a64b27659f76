"""A mixture-of-experts block: a router picks each token's top-k experts (gated MLPs), whose
outputs are summed with the router's weights. Shapes: T tokens, H hidden size, E experts,
I each expert's intermediate size.

The experts' weights are two stacked parameters, gate_up_proj [E, 2I, H] (each expert's gate
rows, then its up rows) and down_proj [E, H, I]. Routing is a softmax over the router's logits
in float32, the top k kept and, where the model says so, renormalised to sum to one. Each
expert that some token picked runs once over its tokens, in expert order, and its weighted
output is added into theirs: the operations transformers runs, in its order, so that float32
output is the same."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pyserve.model.layers.activation import silu_and_mul
from pyserve.model.layers.parallel import SINGLE, TPGroup


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int
    expert_size: int  # I: each expert's intermediate size
    norm_topk_prob: bool  # the top k weights renormalised to sum to one
    sparse_layers: tuple[bool, ...]  # per decoder layer: experts (True) or the dense MLP
    shared_expert_size: int | None = None  # Qwen2-MoE: a dense expert every token takes, gated

    def describe(self, hidden_size: int) -> str:
        """The start-up log's line: experts, top-k and what a token's experts weigh."""
        per_expert = 3 * hidden_size * self.expert_size
        return (f"{self.num_experts} experts, top-{self.top_k}, {sum(self.sparse_layers)} MoE layers of "
                f"{len(self.sparse_layers)}; a token's experts: {self.top_k * per_expert:,} of "
                f"{self.num_experts * per_expert:,} expert parameters per MoE layer")


class SparseMoe(nn.Module):
    def __init__(self, hidden_size: int, spec: MoeSpec, dtype: torch.dtype, shared_expert=None,
                 tp: TPGroup = SINGLE):
        """shared_expert: Qwen2-MoE's dense expert (a module of [T, H] -> [T, H], whole on
        every rank); its output is scaled by the sigmoid of shared_expert_gate and added.
        tp: each expert's intermediate size split across the ranks (vLLM's default), their
        partial sums all-reduced once; the router is whole on every rank."""
        super().__init__()
        e, i = spec.num_experts, tp.shard(spec.expert_size, "the experts' intermediate size")
        self.tp = tp
        self.gate = nn.Linear(hidden_size, e, bias=False, dtype=dtype)  # the router
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, hidden_size, dtype=dtype),
                                                 requires_grad=False)
        self.experts.down_proj = nn.Parameter(torch.empty(e, hidden_size, i, dtype=dtype),
                                              requires_grad=False)
        self.shared_expert = shared_expert
        self.shared_expert_gate = (nn.Linear(hidden_size, 1, bias=False, dtype=dtype)
                                   if shared_expert is not None else None)
        self.top_k, self.norm_topk_prob, self.num_experts = spec.top_k, spec.norm_topk_prob, e

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (weights [T, k] in x's dtype, expert ids [T, k])."""
        logits = F.linear(x, self.gate.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = torch.zeros_like(x)
        # [E, k, T]: which (choice, token) pairs picked each expert
        picked = F.one_hot(ids, num_classes=self.num_experts).permute(2, 1, 0)
        for expert in picked.sum(dim=(1, 2)).nonzero().flatten().tolist():
            choice, token = torch.where(picked[expert])
            rows = F.linear(x[token], self.experts.gate_up_proj[expert])
            rows = F.linear(silu_and_mul(rows), self.experts.down_proj[expert])
            out.index_add_(0, token, rows * weights[token, choice, None])
        out = self.tp.all_reduce(out)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
