"""The CUDA-graph decode path's own logic, on the CPU: batch-size buckets (vLLM's
--cuda-graph-sizes), and DecodeGraphs' static buffers and padding, replayed eagerly
(EagerReplay stands in for pyserve._C.CudaGraphs), against the plain forward of the same
model. The real graphs are checked against eager on a GPU (tests/cuda/test_engine_cuda.py)."""

from pathlib import Path

import pytest
import torch

from pyserve.model.arch import ModelArch
from pyserve.model.cuda_graphs import DecodeGraphs, EagerReplay, capture_sizes
from pyserve.model.loader import load_model
from pyserve.model.runner import ModelRunner
from tests.cuda.test_model import BLOCK_SIZE as STEP_BLOCK_SIZE, step_inputs as step

BLOCK_SIZE, NUM_BLOCKS, MAX_LEN = STEP_BLOCK_SIZE, 48, 256


def test_capture_sizes_follow_vllm():
    assert capture_sizes(None, 256) == (1, 2, 4, *range(8, 257, 8))
    assert capture_sizes(None, 20) == (1, 2, 4, 8, 16, 20)  # the largest batch gets a graph
    assert capture_sizes((32,), 256) == (1, 2, 4, 8, 16, 24, 32)
    assert capture_sizes((3, 1, 64, 1000), 128) == (1, 3, 64)
    assert capture_sizes(None, 4096)[-1] == 512


def tiny_arch() -> ModelArch:
    return ModelArch(
        architecture="LlamaForCausalLM", vocab_size=320, hidden_size=128, intermediate_size=256,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=10000.0, rope_scaling=None, max_position_embeddings=MAX_LEN,
        tie_word_embeddings=False, attention_bias=False, qk_norm=False, sliding_window=None,
        torch_dtype=None, bos_token_id=1, eos_token_ids=(2,))


def make_runner() -> ModelRunner:
    arch = tiny_arch()
    model = load_model(arch, Path("."), "dummy", torch.float32, torch.device("cpu"), MAX_LEN, seed=0)
    shape = (NUM_BLOCKS, arch.num_kv_heads, BLOCK_SIZE, arch.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(arch.num_layers)]
    return ModelRunner(model, caches, BLOCK_SIZE, torch.device("cpu"), seed=0)


@pytest.mark.parametrize("batch", [1, 3, 5, 8])
def test_padded_replay_matches_the_plain_forward(batch):
    """Prefill eagerly on two runners (one with graphs of sizes 1, 4, 8), then decode steps:
    the graph runner pads 3 -> 4 and 5 -> 8, writes nothing for padding rows, and gives the
    plain runner's logits; its KV cache ends up identical."""
    plain, graphed = make_runner(), make_runner()
    max_blocks = MAX_LEN // BLOCK_SIZE
    graphed.graphs = DecodeGraphs(graphed.model, graphed.kv_caches, (1, 4, 8), max_blocks,
                                  torch.device("cpu"), EagerReplay())
    graphed.graphs.capture_all()
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in range(9, 9 + 5 * batch, 5)]
    blocks = [[5 * i + j for j in range(5)][::-1] for i in range(batch)]
    prefill = step([(p, b, 0, len(p)) for p, b in zip(prompts, blocks)])
    assert graphed.graphs.bucket(prefill) is None  # prompts run eagerly
    for runner in (plain, graphed):
        runner.execute_model(prefill)
    for _ in range(3):
        for p in prompts:
            p.append(int(torch.randint(3, 320, (1,), generator=gen)))
        decode = step([(p, b, len(p) - 1, len(p)) for p, b in zip(prompts, blocks)])
        assert graphed.graphs.bucket(decode) == next(s for s in (1, 4, 8) if s >= batch)
        expected, actual = plain.execute_model(decode), graphed.execute_model(decode)
        torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-6)
    for (k0, v0), (k1, v1) in zip(plain.kv_caches, graphed.kv_caches):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_batches_beyond_the_largest_graph_run_eagerly():
    runner = make_runner()
    graphs = DecodeGraphs(runner.model, runner.kv_caches, (1, 2), MAX_LEN // BLOCK_SIZE,
                          torch.device("cpu"), EagerReplay())
    prompts = [[5, 6, 7]] * 3
    decode = step([(p, [i], 2, 3) for i, p in enumerate(prompts)])
    assert graphs.bucket(decode) is None


def test_padded_replay_with_hybrid_kv_groups_matches_the_plain_forward():
    """A sliding layer and a global one in KV groups of their own (kv/groups.py): the graph
    buffers carry both groups' slots and tables, null-block entries included."""
    import dataclasses

    from pyserve.kv.cache import KVLayout, allocate_kv_caches
    from pyserve.kv.groups import plan_kv_groups
    from pyserve.step import SamplingInputs, ScheduledSequence, SchedulerOutput
    from pyserve.sampling_params import SamplingParams

    arch = dataclasses.replace(tiny_arch(), sliding_window=8,
                               layer_types=("sliding_attention", "full_attention"))
    groups = plan_kv_groups([arch.layer_window(i) for i in range(2)], MAX_LEN)
    assert groups.num_groups == 2
    layout = KVLayout(2, arch.num_kv_heads, arch.head_dim, torch.float32, groups)

    model = load_model(arch, Path("."), "dummy", torch.float32, torch.device("cpu"), MAX_LEN, seed=0)

    def runner():
        caches = allocate_kv_caches(layout, NUM_BLOCKS, BLOCK_SIZE, torch.device("cpu"))
        for c in caches:  # left uninitialised; zeroed so that the caches compare whole
            c.key.zero_(), c.value.zero_()
        return ModelRunner(model, caches, BLOCK_SIZE, torch.device("cpu"), 0, NUM_BLOCKS)

    plain, graphed = runner(), runner()
    graphed.graphs = DecodeGraphs(graphed.model, graphed.kv_caches, (1, 4), MAX_LEN // BLOCK_SIZE,
                                  torch.device("cpu"), EagerReplay())
    graphed.graphs.capture_all()
    greedy = SamplingInputs(SamplingParams(temperature=0.0), (), 0)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (40, 23, 35)]
    full = [[10 * i + j for j in range(4)] for i in range(3)]
    window = [[24 + 8 * i + j for j in range(4)] for i in range(3)]  # below NUM_BLOCKS (48)

    def batch(first):
        seqs = []
        for p, f, w in zip(prompts, full, window):
            start = len(p) - 1 if not first else 0
            sliding = [NUM_BLOCKS if (b + 1) * BLOCK_SIZE <= start - 7 else w[b] for b in range(len(f))]
            seqs.append(ScheduledSequence("r", p[start:], start, f, greedy, group_block_ids=[sliding]))
        return SchedulerOutput(seqs)

    prefill = plain.prepare(batch(True)).inputs
    for r in (plain, graphed):
        r.execute_model(prefill)
    for _ in range(3):
        for p in prompts:
            p.append(int(torch.randint(3, 320, (1,), generator=gen)))
        decode = plain.prepare(batch(False)).inputs
        assert decode.meta.group_block_tables.shape[0] == 2
        assert (decode.meta.group_block_tables[1] == NUM_BLOCKS).any()  # null entries read nothing
        assert graphed.graphs.bucket(decode) == 4
        torch.testing.assert_close(graphed.execute_model(decode), plain.execute_model(decode),
                                   atol=1e-6, rtol=1e-6)
    for a, b in zip(plain.kv_caches, graphed.kv_caches):
        assert torch.equal(a.key, b.key) and torch.equal(a.value, b.value)
