"""Linear layers in column- and row-parallel form (vLLM's shapes). Each parameter carries a
weight_loader that copies the caller's slice of a checkpoint tensor into place, so a rank
never holds more than its shard and loading needs no full extra copy of the model."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pyserve import _native
from pyserve.model.layers.parallel import SINGLE, TPGroup, kv_heads_per_rank
from pyserve.model.layers.quantized import (GGUFBlocks, GGUFParts, part_destination, source_tensor,
                                            weight_destination)

# Up to this many rows (decode steps, short chunks) our packed kernel runs a layer; above it a
# step is a prefill whose GEMM BLAS runs faster, even after widening the packed weight back
# to float32 [N, K] for it. A GGUF panel (uint8) stays ahead of widening + BLAS for longer: it
# is read once from memory and dequantized in L1-sized chunks, where the widened weight is
# written and read again (9 repeats: at 320 rows 284 against 230 GFLOP/s, at 384 272 against
# 243, at 512 237 against 262); an int8-activation panel outruns BLAS at every row count.
# benchmarks/linear.py measures both sides of these thresholds.
PACKED_MAX_ROWS = 256
QUANTIZED_PACKED_MAX_ROWS = 384

# With bfloat16 GEMMs (--dtype bfloat16 on a CPU that multiplies bfloat16 fast) a layer of at
# least min_rows(packed) rows rounds its input to bfloat16 for one GEMM on a bfloat16 copy of
# its weight; below, the packed kernel (memory-bound at few rows) stays ahead. The thresholds
# are measured per kind of hardware with python -m benchmarks.linear (SmolLM2's 30 layers):
# - AMX-BF16 (oneDNN's tiles, several times float32's rate; two Sapphire Rapids-class
#   cores): 16 rows took 19.7 ms as a bf16 GEMM against 14.2 packed Q4_1 and 27.9 packed
#   bf16; 32 rows 24.9 against 24.3 and 50.2; 64 rows 30.1 against 49.8. Int8-activation
#   panels hold out longer (128 rows: 40.5 against 40.8 ms; 256: 62.4 against 77.3).
# - AVX-512 BF16 alone (vdpbf16ps, 2 bfloat16 products per float32 lane; two Zen 4 cores,
#   2026-12-04): the GEMM ran 152-333 GFLOP/s from 32 to 128 rows where float32 BLAS ran
#   59-150. Against packed bfloat16 weights it wins from 16 rows (38.5 ms against 44.8;
#   8 rows: 22.1 against 20.4), against packed Q4_1 from 48 (54.4 against 58.5; 32 rows: 44.6
#   against 37.0), and never against int8-activation panels (vpdpbusd: 371-587 GFLOP/s at
#   16-128 rows, against 88-333), which keep no bfloat16 copy there.
@dataclass(frozen=True)
class BF16GemmRows:
    """From how many rows a step runs a layer as one bfloat16 GEMM, by its packed weight."""

    hardware: str  # what multiplies bfloat16 here, for the start-up line
    float_panels: int  # float32 / bfloat16 weights
    gguf_panels: int  # GGUF blocks with float32 activations (uint8 panels)
    int8_panels: int | None  # GGUF blocks with int8 activations; None: never

    def min_rows(self, packed: torch.Tensor) -> int | None:
        if packed.dtype == torch.int8:
            return self.int8_panels
        return self.gguf_panels if packed.dtype == torch.uint8 else self.float_panels


BF16_GEMM_AMX = BF16GemmRows("AMX", 32, 32, 128)
BF16_GEMM_AVX512 = BF16GemmRows("AVX-512 BF16", 16, 48, None)


def bf16_gemm_rows() -> BF16GemmRows | None:
    """This CPU's bfloat16 GEMM thresholds (above), or None where bfloat16 GEMMs do not pay
    (no AMX and no AVX-512 BF16: oneDNN then emulates them, slower than float32)."""
    if torch.cpu._is_amx_tile_supported():
        return BF16_GEMM_AMX
    if torch.cpu._is_avx512_bf16_supported():
        return BF16_GEMM_AVX512
    return None


def bf16_gemm_supported() -> bool:
    return bf16_gemm_rows() is not None


def packed_max_rows(packed: torch.Tensor, bf16_gemm: BF16GemmRows | None = None) -> int:
    """The most rows of x the packed kernel takes for this packed weight (see above); more go
    to BLAS, or to the bfloat16 GEMM where the layer has one (bf16_gemm)."""
    gemm_rows = None if bf16_gemm is None else bf16_gemm.min_rows(packed)
    if gemm_rows is not None:
        return gemm_rows - 1
    if packed.dtype == torch.int8:
        return torch.iinfo(torch.int64).max
    return QUANTIZED_PACKED_MAX_ROWS if packed.dtype == torch.uint8 else PACKED_MAX_ROWS


def pack_for_cpu(layer: nn.Module, int8_activations: bool = False,
                 bf16_gemm: BF16GemmRows | None = None, bf16x3: bool = False) -> None:
    """Replaces layer.weight [N, K] (float32 or bfloat16, on the CPU), or the GGUF blocks
    loaded in its place, by their packed form, which only apply_linear and the embedding
    lookup read. The unpacked copy is freed. int8_activations: a GGUF layer then quantizes its
    input to int8 for integer dot products (packed as int8; see csrc/cpu/ops.h).
    bf16_gemm: the layer also keeps its weight as plain bfloat16 [N, K] (gemm_weight, 2 bytes a
    weight besides the packed form) for steps of bf16_gemm.min_rows rows or more, unless its
    packed kernel is the faster at every row count.
    bf16x3: a float32 weight whose sides are multiples of 32 is packed for bfloat16x3 GEMMs on
    AMX instead (bf16x3_weight), where this CPU has them, which then run every step of the
    layer: from 32 rows on they outran both the packed kernel and BLAS, at 16 rows in three of
    MiniLM's four shapes (csrc/cpu/bf16x3.cpp); an encoder's steps are its whole inputs."""
    weight = layer.weight.data
    if (bf16x3 and _native.bf16x3_supported() and layer.gguf is None and weight.dtype == torch.float32
            and weight.shape[0] % 32 == 0 and weight.shape[1] % 32 == 0):
        layer.bf16x3_weight = _native.pack_bf16x3_weight(weight)
        layer.out_features = weight.shape[0]
        layer.weight.data = weight.new_empty(0, weight.shape[1])
        return
    _pack(layer, int8_activations)
    parts = ([(layer.packed, layer.out_features)] if layer.packed is not None
             else layer.packed_parts)
    layer.max_packed_rows = min(packed_max_rows(p, bf16_gemm) for p, _ in parts)
    if bf16_gemm is not None and any(bf16_gemm.min_rows(p) is not None for p, _ in parts):
        layer.gemm_weight = torch.cat([_native.unpack_linear_weight(p, rows).bfloat16()
                                       for p, rows in parts])


def _pack(layer: nn.Module, int8_activations: bool) -> None:
    weight, gguf = layer.weight.data, layer.gguf
    if isinstance(gguf, GGUFParts) and len(gguf.types) > 1:
        # a merged parameter of several types: one packed weight per part, each part's
        # outputs computed by its own kernel (layer.packed stays None)
        layer.packed_parts = [(_native.pack_gguf_weight(p.blocks, p.shape[1], p.type,
                                                        int8_activations=int8_activations), p.shape[0])
                              for p in gguf.parts]
        layer.gguf = None
    elif gguf is not None:
        if isinstance(gguf, GGUFParts):
            gguf = gguf.joined()
        layer.packed = _native.pack_gguf_weight(gguf.blocks, gguf.shape[1], gguf.type,
                                                int8_activations=int8_activations)
        layer.gguf = None
    else:
        layer.packed = _native.pack_linear_weight(weight)
    layer.out_features = weight.shape[0]
    layer.weight.data = weight.new_empty(0, weight.shape[1])


def apply_linear(x: torch.Tensor, layer: nn.Module, bias: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] · layer's weight [N, K]ᵀ + bias, in x's dtype (float32 on the CPU, whose
    weights may be stored as bfloat16: half the bytes to read). out: a contiguous [M, N]
    float32 tensor for the packed kernel to write into (other paths allocate theirs)."""
    bf16x3 = getattr(layer, "bf16x3_weight", None)
    if bf16x3 is not None:
        return _native.bf16x3_linear(x.contiguous(), bf16x3, layer.out_features, bias)
    gemm = getattr(layer, "gemm_weight", None)
    if gemm is not None and x.shape[0] > layer.max_packed_rows:
        return bf16_linear(x, gemm, bias)
    packed = layer.packed
    if packed is None:
        if getattr(layer, "packed_parts", None) is not None:
            return _apply_parts(x, layer.packed_parts, bias)
        return F.linear(x, layer.weight.to(x.dtype), bias)
    if x.shape[0] <= layer.max_packed_rows:
        if out is None:
            out = x.new_empty(x.shape[0], layer.out_features)
        _native.packed_linear(out, x.contiguous(), packed, bias)
        return out
    return F.linear(x, _native.unpack_linear_weight(packed, layer.out_features), bias)


# the activations an epilogue may fuse (bf16x3_linear's names), as PyTorch computes them
ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


def apply_linear_activation(x: torch.Tensor, layer: nn.Module, activation: str) -> torch.Tensor:
    """ACTIVATIONS[activation](layer(x)) for a single-rank layer; a layer packed for bfloat16x3
    GEMMs applies it in the GEMM's epilogue, while each block of the output is in L1 (its erf
    is PyTorch's vectorized formula, Abramowitz and Stegun 7.1.26: within 2e-6 of F.gelu)."""
    bf16x3 = getattr(layer, "bf16x3_weight", None)
    if bf16x3 is not None:
        return _native.bf16x3_linear(x.contiguous(), bf16x3, layer.out_features, layer.bias, activation)
    return ACTIVATIONS[activation](layer(x))


def native_linear(layer: nn.Module):
    """The layer as the native decoder layers run it (_native.PackedLinear: apply_linear's
    rules, in csrc/cpu/decoder_layer.h), or None where pack_for_cpu did not pack it."""
    if layer.packed is not None:
        parts = [(layer.packed, layer.out_features, layer.max_packed_rows)]
    elif getattr(layer, "packed_parts", None) is not None:
        parts = [(packed, rows, packed_max_rows(packed)) for packed, rows in layer.packed_parts]
    else:
        return None
    return _native.PackedLinear(parts, layer.bias, layer.max_packed_rows, layer.gemm_weight)


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x · weightᵀ (+ bias) with x rounded to bfloat16 for a bfloat16 GEMM (float32
    accumulation inside; the output comes back rounded to bfloat16, as vLLM's bfloat16 GEMMs
    give it), widened to float32 for the rest of the model. The bias is added in float32."""
    out = F.linear(x.to(torch.bfloat16), weight).float()
    return out if bias is None else out.add_(bias)


def _apply_parts(x: torch.Tensor, parts, bias: torch.Tensor | None) -> torch.Tensor:
    """A merged layer packed per part (pack_for_cpu): each part's output columns from its own
    kernel (the packed one while the rows fit it, else its widened weight through BLAS)."""
    x = x.contiguous()
    outs = []
    start = 0
    for packed, rows in parts:
        part_bias = None if bias is None else bias[start:start + rows]
        if x.shape[0] <= packed_max_rows(packed):
            out = x.new_empty(x.shape[0], rows)
            _native.packed_linear(out, x, packed, part_bias)
        else:
            out = F.linear(x, _native.unpack_linear_weight(packed, rows), part_bias)
        outs.append(out)
        start += rows
    return torch.cat(outs, dim=1)


def _param(shape, dtype, loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader
    return p


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split across ranks; output stays sharded."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, dtype: torch.dtype,
                 tp: TPGroup = SINGLE):
        super().__init__()
        self.tp = tp
        # Each logical output (q, k, v or gate, up) is sharded on its own and the shards are
        # stacked: rank r holds [q_r; k_r; v_r].
        self.shard_sizes = [tp.shard(n, "output size") for n in output_sizes]
        self.shard_offsets = [sum(self.shard_sizes[:i]) for i in range(len(self.shard_sizes))]
        out = sum(self.shard_sizes)
        self.weight = _param((out, input_size), dtype, self._load)
        self.bias = _param((out,), dtype, self._load) if bias else None
        self.packed = None  # set by pack_for_cpu
        self.packed_parts = None  # instead, per part: a merged GGUF weight of several types
        self.gemm_weight = None  # bfloat16 [N, K] for bfloat16 GEMMs (pack_for_cpu's bf16_gemm)
        self.bf16x3_weight = None  # instead of packed: for bfloat16x3 GEMMs (pack_for_cpu's bf16x3)
        self.gguf = None  # GGUF blocks loaded in place of weight (layers/quantized.py)

    def shard_range(self, shard_id: int, loaded_rows: int) -> tuple[int, int]:
        """Rows of the checkpoint tensor this rank takes for logical output shard_id."""
        size = self.shard_sizes[shard_id]
        return self.tp.rank * size, size

    def _load(self, param: nn.Parameter, loaded, shard_id: int = 0) -> None:
        start, size = self.shard_range(shard_id, loaded.shape[0])
        source = source_tensor(loaded.narrow(0, start, size))
        if isinstance(loaded, GGUFBlocks) and len(self.shard_sizes) > 1:
            # a merged weight's parts may differ in type: each keeps a buffer of its own
            destination = part_destination(self, loaded, shard_id, len(self.shard_sizes), size,
                                           param.shape[1])
        else:
            destination = weight_destination(self, param, loaded).narrow(0, self.shard_offsets[shard_id], size)
        destination.copy_(source)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_linear(x, self, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """The merged q/k/v projection. With fewer KV heads than ranks, KV heads are replicated:
    each rank keeps the one KV head its query heads use."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool, dtype: torch.dtype, tp: TPGroup = SINGLE):
        self.num_kv_heads_per_rank = kv_heads_per_rank(num_kv_heads, tp.size)
        self.kv_replicas = max(1, tp.size // num_kv_heads)
        kv_out = self.num_kv_heads_per_rank * head_dim * tp.size
        super().__init__(hidden_size, [num_heads * head_dim, kv_out, kv_out], bias, dtype, tp)
        self.head_dim = head_dim

    def shard_range(self, shard_id: int, loaded_rows: int) -> tuple[int, int]:
        size = self.shard_sizes[shard_id]
        if shard_id == 0:
            return self.tp.rank * size, size
        return (self.tp.rank // self.kv_replicas) * size, size


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split across ranks; the ranks' partial sums are
    added through the group's communicator, so every rank ends with the full y."""

    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype,
                 tp: TPGroup = SINGLE):
        super().__init__()
        self.tp = tp
        self.input_per_rank = tp.shard(input_size, "input size")
        self.weight = _param((output_size, self.input_per_rank), dtype, self._load_weight)
        self.bias = _param((output_size,), dtype, self._load_bias) if bias else None
        self.packed = None  # set by pack_for_cpu
        self.gemm_weight = None  # bfloat16 [N, K] for bfloat16 GEMMs (pack_for_cpu's bf16_gemm)
        self.bf16x3_weight = None  # instead of packed: for bfloat16x3 GEMMs (pack_for_cpu's bf16x3)
        self.gguf = None  # GGUF blocks loaded in place of weight (layers/quantized.py)

    def _load_weight(self, param: nn.Parameter, loaded) -> None:
        n = self.input_per_rank
        weight_destination(self, param, loaded).copy_(source_tensor(loaded.narrow(1, self.tp.rank * n, n)))

    def _load_bias(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded[...])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return apply_linear(x, self, self.bias)
        out = self.tp.all_reduce(apply_linear(x, self))
        # the bias joins after the reduction, once rather than once per rank
        return out if self.bias is None else out + self.bias
