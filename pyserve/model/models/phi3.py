"""Phi-3 and Phi-4 (Phi3ForCausalLM): the Llama decoder with its q/k/v projections in one
checkpoint tensor (qkv_proj) and its gate and up projections in another (gate_up_proj), which
are cut into the merged layers' parts here so that each tensor-parallel rank takes its own.
LongRoPE (Phi-3's long-context checkpoints) and a partial rotary factor (Phi-4-mini) are
start-up errors naming them (layers/rotary.py, model/arch.py)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pyserve.model.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        arch = self.arch
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        parts = {".qkv_proj.": [("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)],
                 ".gate_up_proj.": [("gate_proj", 0, arch.intermediate_size),
                                    ("up_proj", arch.intermediate_size, arch.intermediate_size)]}

        def split():  # the Llama names of each fused tensor's rows: the Llama loader merges them
            for name, tensor in weights:
                fused = next((f for f in parts if f in name), None)
                if fused is None:
                    yield name, tensor
                    continue
                for part, start, rows in parts[fused]:
                    yield name.replace(fused, f".{part}."), tensor.narrow(0, start, rows)

        return super().load_weights(split())
