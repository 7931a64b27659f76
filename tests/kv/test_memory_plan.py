"""GPU KV-cache sizing arithmetic (kv/memory.py) and its refusal, without a GPU; the
measurement itself runs in tests/cuda/test_engine_cuda.py."""

import pytest

from pyserve.kv.memory import GIB, MemoryProfile, check_fits, memory_table, plan_kv_cache
from pyserve.errors import ModelLoadError


def profile(**changes) -> MemoryProfile:
    values = dict(total=80 * GIB, weights=16 * GIB, peak_activations=2 * GIB,
                  non_torch=GIB // 2, graph_reserve=GIB // 4)
    values.update(changes)
    return MemoryProfile(**values)


def test_kv_gets_what_utilization_leaves():
    per_block = 2 * 1024**2
    plan = plan_kv_cache(profile(), 0.9, per_block)
    left = int(80 * GIB * 0.9) - 16 * GIB - 2 * GIB - GIB // 2 - GIB // 4
    assert plan.num_blocks == left // per_block
    assert plan.kv_bytes == plan.num_blocks * per_block <= left < plan.kv_bytes + per_block


def test_nothing_left_is_zero_blocks_and_a_clear_error():
    p = profile(weights=75 * GIB)
    plan = plan_kv_cache(p, 0.9, 1024**2)
    assert plan.num_blocks == 0
    with pytest.raises(ModelLoadError) as err:
        check_fits(plan, p, 0.9, 16, 8192)
    message = str(err.value)
    for flag in ("--gpu-memory-utilization", "--max-model-len", "--enforce-eager"):
        assert flag in message
    assert "model weights 75.00 GiB" in message


def test_one_full_sequence_is_enough():
    per_block = 1024**2
    plan = plan_kv_cache(profile(), 0.9, per_block)
    check_fits(plan, profile(), 0.9, 16, plan.num_blocks * 16)
    with pytest.raises(ModelLoadError):
        check_fits(plan, profile(), 0.9, 16, plan.num_blocks * 16 + 1)


def test_table_names_every_part():
    table = memory_table(profile(), 0.9, plan_kv_cache(profile(), 0.9, 1024**2))
    for part in ("device total 80.00 GiB", "model weights 16.00 GiB", "peak activations",
                 "CUDA graph reserve 0.25 GiB", "KV cache"):
        assert part in table


def test_profiling_forward_runs_any_shape_and_frees_its_cache():
    """The forward whose peak sizes the KV cache, here on the CPU: token counts that do and do
    not divide over the sequences, and more tokens than one sequence may hold."""
    from pathlib import Path

    import torch

    from pyserve.executor.shard import ShardSpec, _profiling_forward
    from pyserve.model.loader import load_model
    from tests.model.test_decode_graphs import tiny_arch

    arch = tiny_arch()
    spec = ShardSpec(arch, Path("."), "dummy", torch.float32, "cpu", max_model_len=64, seed=0,
                     block_size=16, num_blocks=None, tensor_parallel_size=1, max_num_seqs=4)
    model = load_model(arch, Path("."), "dummy", torch.float32, torch.device("cpu"), 64, seed=0)
    from pyserve.executor.shard import kv_layout
    from pyserve.model.layers.parallel import SINGLE

    forward = _profiling_forward(model, spec, SINGLE, torch.device("cpu"), kv_layout(spec, 1))
    for tokens in (1, 7, 100, 300):
        assert forward(tokens) is None


def test_cuda_needs_a_cuda_device():
    import torch

    from pyserve.executor.plan import resolve_device

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    assert resolve_device("auto").type == "cpu"
    with pytest.raises(ModelLoadError, match="no CUDA device"):
        resolve_device("cuda")
