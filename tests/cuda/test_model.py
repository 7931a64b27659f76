"""The whole Llama model on CUDA against the same model on the CPU: random weights (load
format "dummy", one seed, so both devices get the same weights), the same hand-built steps
through ModelRunner.execute_model (prefill chunks, then mixed prefill and decode, then
decode), greedy ids equal and logits close.

Tolerances: float32 logits within 2e-4 (cuBLAS and the CPU sum in different orders; TF32 is
off by default); a bfloat16 CUDA model within 5% of the float32 CPU logits in norm."""

from pathlib import Path

import pytest
import torch

from pyserve import _native
from pyserve.model.arch import ModelArch
from pyserve.model.layers.attention import AttentionMetadata
from pyserve.model.loader import load_model
from pyserve.model.runner import ForwardInputs, ModelRunner

CUDA = torch.cuda.is_available() and _native.built_with_cuda()
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not CUDA, reason="needs a CUDA device and a CUDA build of pyserve._C"),
]

BLOCK_SIZE, NUM_BLOCKS, MAX_POSITIONS = 16, 64, 1024


def tiny_arch(num_heads: int, num_kv_heads: int, head_dim: int) -> ModelArch:
    return ModelArch(
        architecture="LlamaForCausalLM", vocab_size=384, hidden_size=256, intermediate_size=512,
        num_layers=2, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        rms_norm_eps=1e-5, rope_theta=10000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False, attention_bias=False,
        qk_norm=False, sliding_window=None, torch_dtype=None, bos_token_id=1, eos_token_ids=(2,))


def runner_on(arch: ModelArch, device: str, dtype: torch.dtype) -> ModelRunner:
    model = load_model(arch, Path("."), "dummy", dtype, torch.device(device), MAX_POSITIONS, seed=0)
    shape = (NUM_BLOCKS, arch.num_kv_heads, BLOCK_SIZE, arch.head_dim)
    caches = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
              for _ in range(arch.num_layers)]
    return ModelRunner(model, caches, BLOCK_SIZE, torch.device(device), seed=0)


def step_inputs(work: list[tuple[list[int], list[int], int, int]]) -> ForwardInputs:
    """work: per sequence (all its token ids, its block ids, first, last): this step computes
    positions first..last-1; logits for each sequence's last row."""
    ids, positions, slots, starts, seq_lens, rows = [], [], [], [0], [], []
    tables = torch.zeros(len(work), max(len(b) for _, b, _, _ in work), dtype=torch.int32)
    for i, (tokens, blocks, first, last) in enumerate(work):
        ids += tokens[first:last]
        positions += range(first, last)
        slots += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(first, last)]
        starts.append(starts[-1] + last - first)
        seq_lens.append(last)
        tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        rows.append(starts[-1] - 1)
    meta = AttentionMetadata(torch.tensor(slots), tables, torch.tensor(starts, dtype=torch.int32),
                             torch.tensor(seq_lens, dtype=torch.int32))
    return ForwardInputs(torch.tensor(ids), torch.tensor(positions), meta, torch.tensor(rows))


def run_steps(runners: list[ModelRunner]) -> list[list[torch.Tensor]]:
    """Three steps over three sequences on every runner: prefill (one prompt in two chunks),
    mixed (a decode, the rest of the chunked prompt, a decode), decode. The next token of each
    sequence is the first runner's greedy choice, so all runners see the same inputs."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 384, (n,), generator=gen).tolist() for n in (40, 70, 5)]
    blocks = [list(range(0, 8)), list(range(20, 28)), list(range(40, 42))]
    blocks = [b[::-1] for b in blocks]  # blocks out of order, as a pool hands them out
    schedule = [
        [(0, 0, 40), (1, 0, 64), (2, 0, 5)],
        [(0, 40, 41), (1, 64, 70), (2, 5, 6)],
        [(0, 41, 42), (1, 70, 71), (2, 6, 7)],
    ]
    logits = [[] for _ in runners]
    for step in schedule:
        inputs = step_inputs([(prompts[s], blocks[s], first, last) for s, first, last in step])
        for r, runner in enumerate(runners):
            logits[r].append(runner.execute_model(inputs).cpu())
        for (s, _, last), token in zip(step, logits[0][-1].argmax(-1).tolist()):
            if last == len(prompts[s]):  # all its tokens are computed: append the next one
                prompts[s].append(token)
    return logits


def test_cuda_model_matches_cpu_model():
    for num_heads, num_kv_heads, head_dim in ((8, 2, 64), (4, 1, 128)):
        arch = tiny_arch(num_heads, num_kv_heads, head_dim)
        cpu, gpu, gpu_bf16 = (runner_on(arch, "cpu", torch.float32), runner_on(arch, "cuda", torch.float32),
                              runner_on(arch, "cuda", torch.bfloat16))
        expected, actual, actual_bf16 = run_steps([cpu, gpu, gpu_bf16])
        for step, (e, a, b) in enumerate(zip(expected, actual, actual_bf16)):
            what = f"heads {num_heads}/{num_kv_heads} D={head_dim} step {step}"
            assert torch.equal(a.argmax(-1), e.argmax(-1)), what
            torch.testing.assert_close(a, e, atol=2e-4, rtol=2e-4, msg=lambda m: f"{what}: {m}")
            assert ((b - e).norm() / e.norm()).item() < 0.05, what
