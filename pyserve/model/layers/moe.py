"""A mixture-of-experts block: a router picks each token's top-k experts (gated MLPs), whose
outputs are summed with the router's weights. Shapes: T tokens, H hidden size, E experts,
I each expert's intermediate size.

The experts' weights are two stacked parameters, gate_up_proj [E, 2I, H] (each expert's gate
rows, then its up rows) and down_proj [E, H, I]. Routing is a softmax over the router's logits
in float32, the top k kept and, where the model says so, renormalised to sum to one. Each
expert that some token picked runs once over its tokens, in expert order, and its weighted
output is added into theirs: the operations transformers runs, in its order, so that float32
output is the same.

On the CPU with float32 activations the experts are packed once after loading
(pack_experts: the packed float32 panels of layers/linear.py, or a GGUF file's own blocks,
never widened) and one native call, _native.fused_moe (csrc/cpu/moe.cpp), runs them all:
rows grouped by expert, every picked expert's projections in one parallel region, the
weighted sum in the same order as the loop below. Elsewhere (CUDA) the loop runs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pyserve import _native
from pyserve.model.layers.activation import silu_and_mul
from pyserve.model.layers.parallel import SINGLE, TPGroup
from pyserve.model.layers.quantized import GGUFExperts


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
        self.expert_size = i  # this rank's share of each expert's intermediate size
        # GGUF blocks loaded in place of gate_up_proj's halves or down_proj (this rank's share),
        # by part: "gate", "up", "down" (a part absent here is in its float parameter)
        self.expert_blocks: dict[str, GGUFExperts] = {}
        # pack_experts' stacks of packed weights: gate_up ([2I, H] each, or gate and up apart
        # when their GGUF types differ) and down ([H, I] each)
        self.packed_gate_up: list[torch.Tensor] | None = None
        self.packed_down: torch.Tensor | None = None

    def pack_experts(self, int8_activations: bool = False) -> None:
        """Packs every expert's weights for the native fused path (on the CPU with float32
        activations), freeing the float parameters. int8_activations: GGUF blocks then take
        int8 activations, as the dense layers' do."""
        blocks = self.expert_blocks

        def stack(n: int, pack_one) -> torch.Tensor:
            first = pack_one(0)
            out = first.new_empty(n, *first.shape)
            out[0] = first
            for e in range(1, n):
                out[e] = pack_one(e)
            return out

        def pack_blocks(part: GGUFExperts, e: int, rows=None) -> torch.Tensor:
            data = part.blocks[e] if rows is None else rows
            return _native.pack_gguf_weight(data, part.shape[2], part.type,
                                            int8_activations=int8_activations)

        n = self.num_experts
        if "gate" in blocks and blocks["gate"].type == blocks["up"].type:
            gate, up = blocks["gate"], blocks["up"]
            self.packed_gate_up = [stack(n, lambda e: pack_blocks(
                gate, e, torch.cat([gate.blocks[e], up.blocks[e]])))]
        elif "gate" in blocks:
            self.packed_gate_up = [stack(n, lambda e: pack_blocks(blocks["gate"], e)),
                                   stack(n, lambda e: pack_blocks(blocks["up"], e))]
        else:
            weight = self.experts.gate_up_proj.data
            self.packed_gate_up = [stack(n, lambda e: _native.pack_linear_weight(weight[e]))]
        if "down" in blocks:
            self.packed_down = stack(n, lambda e: pack_blocks(blocks["down"], e))
        else:
            weight = self.experts.down_proj.data
            self.packed_down = stack(n, lambda e: _native.pack_linear_weight(weight[e]))
        self.expert_blocks = {}
        for param in (self.experts.gate_up_proj, self.experts.down_proj):
            param.data = param.data.new_empty(0)

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
        if self.packed_down is not None:
            out = torch.empty_like(x)
            _native.fused_moe(out, x.contiguous(), ids, weights.contiguous(), self.packed_gate_up,
                              self.packed_down)
        elif x.is_cuda:
            out = self.experts_sorted(x, weights, ids)
        else:
            out = self._experts_loop(x, weights, ids)
        out = self.tp.all_reduce(out)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def experts_sorted(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The experts over rows sorted by expert (the CUDA path; its steps have CPU twins):
        one GEMM per picked expert and projection, then each token's weighted sum in the
        loop's order (_native.moe_sort_rows, moe_combine)."""
        row_of, offsets = _native.moe_sort_rows(ids.contiguous(), self.num_experts)
        k = ids.shape[1]
        xs = torch.empty(ids.numel(), x.shape[1], dtype=x.dtype, device=x.device)
        xs[row_of.flatten()] = x.repeat_interleave(k, dim=0)
        bounds = offsets.tolist()  # the host needs each expert's rows: one sync per layer
        h = xs.new_empty(xs.shape[0], 2 * self.expert_size)
        y = torch.empty_like(xs)
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        picked = [(e, bounds[e], bounds[e + 1]) for e in range(self.num_experts) if bounds[e + 1] > bounds[e]]
        for e, a, b in picked:
            torch.matmul(xs[a:b], gate_up[e].T, out=h[a:b])
        act = silu_and_mul(h)
        for e, a, b in picked:
            torch.matmul(act[a:b], down[e].T, out=y[a:b])
        out = torch.empty_like(x)
        _native.moe_combine(out, y, row_of, ids.contiguous(), weights.float().contiguous())
        return out

    def _experts_loop(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The experts as transformers runs them, one at a time (CUDA, and the reference)."""
        out = torch.zeros_like(x)
        # [E, k, T]: which (choice, token) pairs picked each expert
        picked = F.one_hot(ids, num_classes=self.num_experts).permute(2, 1, 0)
        for expert in picked.sum(dim=(1, 2)).nonzero().flatten().tolist():
            choice, token = torch.where(picked[expert])
            rows = F.linear(x[token], self.experts.gate_up_proj[expert])
            rows = F.linear(silu_and_mul(rows), self.experts.down_proj[expert])
            out.index_add_(0, token, rows * weights[token, choice, None])
        return out
