"""GPU memory sizing of the KV cache, as the start-up memory layout describes.

After the weights are loaded, a profiling forward over --max-num-batched-tokens measures the
activations' peak; the KV cache gets what --gpu-memory-utilization leaves of the device once
weights, that peak, memory outside torch's allocator (CUDA context, NCCL, cuBLAS workspaces)
and the CUDA graphs' reserve are set aside:

    kv = total × utilization − weights − peak activations − non-torch − graph reserve
    blocks = kv // bytes per block

The arithmetic and its table are plain functions of the measurements so that they are tested
anywhere; `measure` is what reads them off a CUDA device."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pyserve.arith import cdiv
from pyserve.errors import ModelLoadError

GIB = 1024**3


@dataclass(frozen=True)
class MemoryProfile:
    """One rank's device memory, bytes."""

    total: int
    weights: int  # torch's allocations after loading the model
    peak_activations: int  # the profiling forward's peak above what was allocated before it
    non_torch: int  # device memory in use that torch's allocator does not hold
    graph_reserve: int  # the CUDA graphs' memory pool, estimated before capture


@dataclass(frozen=True)
class KVPlan:
    num_blocks: int
    kv_bytes: int
    bytes_per_block: int


def plan_kv_cache(profile: MemoryProfile, utilization: float, bytes_per_block: int) -> KVPlan:
    usable = int(profile.total * utilization)
    kv_bytes = usable - profile.weights - profile.peak_activations - profile.non_torch - profile.graph_reserve
    num_blocks = max(0, kv_bytes) // bytes_per_block
    return KVPlan(num_blocks, num_blocks * bytes_per_block, bytes_per_block)


def check_fits(plan: KVPlan, profile: MemoryProfile, utilization: float, block_size: int,
               max_model_len: int, need: int | None = None) -> None:
    """Refuses a KV cache that cannot hold one sequence of --max-model-len, naming the flags.
    need: the blocks that sequence holds (default: one per block_size tokens)."""
    need = cdiv(max_model_len, block_size) if need is None else need
    if plan.num_blocks >= need:
        return
    raise ModelLoadError(
        f"not enough GPU memory for the KV cache: {plan.num_blocks} blocks of {block_size} tokens "
        f"fit, one sequence of --max-model-len {max_model_len} needs {need} "
        f"({need * plan.bytes_per_block / GIB:.2f} GiB). {memory_table(profile, utilization, plan)} "
        "Raise --gpu-memory-utilization, lower --max-model-len or --max-num-batched-tokens, "
        "add --enforce-eager (no graph reserve), or use more GPUs (--tensor-parallel-size)")


def memory_table(profile: MemoryProfile, utilization: float, plan: KVPlan) -> str:
    rows = [("device total", profile.total),
            (f"usable at --gpu-memory-utilization {utilization:g}", int(profile.total * utilization)),
            ("model weights", profile.weights),
            ("peak activations (profiling forward)", profile.peak_activations),
            ("outside torch (CUDA context, NCCL, cuBLAS)", profile.non_torch),
            ("CUDA graph reserve", profile.graph_reserve),
            (f"KV cache: {plan.num_blocks} blocks x {plan.bytes_per_block} bytes", plan.kv_bytes)]
    return "GPU memory: " + "; ".join(f"{name} {value / GIB:.2f} GiB" for name, value in rows) + "."


def measure(device, weights_bytes: int, forward: Callable[[int], None], profile_tokens: int,
            graph_tokens: int) -> MemoryProfile:
    """Runs forward(num_tokens) on a CUDA device: at profile_tokens for the activations' peak,
    and at graph_tokens (the largest CUDA-graph batch; 0 without graphs) for the graph pool's
    estimate. Everything those forwards allocated is released again."""
    import torch

    def peak_of(num_tokens: int) -> int:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        forward(num_tokens)
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - before)

    peak = peak_of(profile_tokens)
    graph_reserve = peak_of(graph_tokens) if graph_tokens > 0 else 0
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    return MemoryProfile(total, weights_bytes, peak, non_torch, graph_reserve)
