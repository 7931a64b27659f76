"""The CPU linear layers of SmolLM2-135M's 30 decoder layers (qkv, o, gate/up and down
projections) at a range of row counts: BLAS (torch's F.linear) on float32 weights against our
packed kernel (csrc/cpu/linear.cpp) on float32, bfloat16 and GGUF Q4_1 weights, Q4_1 with
int8 activations (--gguf-activations int8, where the CPU has AVX2 or AVX-512 VNNI), and BLAS on the
packed weight widened back (what apply_linear does above PACKED_MAX_ROWS).

    python -m benchmarks.linear [--rows 1,4,16,64,256,512] [--repeats 5]

Prints milliseconds per pass over all 30 layers and the GFLOP/s that is (2 · rows · 106 M
multiply-adds); the random weights and quants have the real shapes, so the times are the
model's. Then, at decode shape (one row), the packed kernel's weight bandwidth per GGUF block
type (GB/s of packed weight read), over three layers of a 1B Llama's shapes (TinyLlama: K of
2,048 and 5,632, multiples of the K-quants' 256), too large for the caches; and, on one thread
with a 1,024 x 2,048 weight that stays in the caches, each type's dequantize-and-multiply
rate in G weights/s (best of 200 calls): the kernel's own cost, which the memory hides at two
threads for the cheap types and not for the 5- and 6-bit ones. Last, the prefill rate of each
type's int8-activation kernel (--int8-rows, G multiply-adds/s) on a Qwen3-1.7B gate/up weight
(6,144 x 2,048) and on one expert of Qwen3-30B-A3B (1,536 x 2,048), each on every thread.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

from pyserve import _native

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K) of one SmolLM2 layer
LAYERS = 30


def _q4_1_blocks(n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    groups = k // 32
    d = rng.uniform(1e-3, 0.05, (n, groups, 1)).astype(np.float16).view(np.uint8)
    m = rng.uniform(-0.4, 0.0, (n, groups, 1)).astype(np.float16).view(np.uint8)
    qs = rng.integers(0, 256, (n, groups, 16), dtype=np.uint8)
    return torch.from_numpy(np.ascontiguousarray(np.concatenate([d, m, qs], axis=2).reshape(n, -1)))


# (N, K) of one TinyLlama-1.1B layer: qkv, o, gate/up, down
DECODE_SHAPES = [(2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632)]
DECODE_LAYERS = 3
# GGUF type -> (weights, bytes) per block, and where its float16 scales sit
GGUF_BLOCKS = {"Q4_0": (32, 18, (0,)), "Q4_1": (32, 20, (0, 2)), "Q5_0": (32, 22, (0,)),
               "Q8_0": (32, 34, (0,)), "Q4_K": (256, 144, (0, 2)), "Q5_K": (256, 176, (0, 2)),
               "Q6_K": (256, 210, (208,))}


def _random_blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """Random quants and integer scales, small float16 scales: what the kernel reads is the
    same for any values."""
    weights, size, scales = GGUF_BLOCKS[kind]
    blocks = rng.integers(0, 256, (n, k // weights, size), dtype=np.uint8)
    for at in scales:
        d = rng.uniform(1e-3, 0.05, (n, k // weights)).astype(np.float16)
        blocks[:, :, at:at + 2] = d.view(np.uint8).reshape(n, k // weights, 2)
    return torch.from_numpy(blocks.reshape(n, -1))


def decode_bandwidth(repeats: int) -> None:
    """One row through DECODE_LAYERS layers per type: GB/s of packed weight bytes, for float32
    activations and, where the type has that kernel, int8 ones (--gguf-activations int8)."""
    rng = np.random.default_rng(0)
    x = {k: torch.randn(1, k) for k in {k for _, k in DECODE_SHAPES}}
    out = {n: torch.empty(1, n) for n, _ in DECODE_SHAPES}
    print(f"\ndecode (1 row), {DECODE_LAYERS} TinyLlama layers: packed weight GB/s per GGUF type "
          "(float32 activations; int8 ones where the type has that kernel)")

    def seconds_per_pass(layers) -> float:
        def one_pass():
            for ws in layers:
                for (n, k), w in zip(DECODE_SHAPES, ws):
                    _native.packed_linear(out[n], x[k], w)
        one_pass()
        start = time.perf_counter()
        for _ in range(repeats * 4):
            one_pass()
        return (time.perf_counter() - start) / (repeats * 4)

    for kind in GGUF_BLOCKS:
        # each layer packed for float32 activations and, where the extension can, for int8
        # ones (the types with that kernel come back marked int8; Q8_0's bytes are ordered for
        # each kernel, so the two are packed apart)
        blocks = [[(_random_blocks(kind, n, k, rng), n, k) for n, k in DECODE_SHAPES]
                  for _ in range(DECODE_LAYERS)]
        floats = [[_native.pack_gguf_weight(b, k, kind) for b, n, k in bs] for bs in blocks]
        layers = [[_native.pack_gguf_weight(b, k, kind, int8_activations=_native.int8_dot_supported())
                   for b, n, k in bs] for bs in blocks]
        total = sum(w.numel() for ws in floats for w in ws)
        seconds = seconds_per_pass(floats)
        bits = total * 8 / (sum(n * k for n, k in DECODE_SHAPES) * DECODE_LAYERS)
        line = (f"  {kind:5} {bits:5.2f} bits/weight  {total / 1e6:6.1f} MB  {seconds * 1e3:7.2f} ms "
                f"{total / seconds / 1e9:6.1f} GB/s")
        if layers[0][0].dtype == torch.int8:
            int8_seconds = seconds_per_pass(layers)
            line += f"   int8 {int8_seconds * 1e3:7.2f} ms {total / int8_seconds / 1e9:6.1f} GB/s"
        print(line, flush=True)
        del layers


def reader_rate() -> None:
    """One row, one thread, a weight that stays in the caches: G weights/s per type with
    float32 activations (the readers' arithmetic, without the memory's limit)."""
    rng = np.random.default_rng(1)
    n, k = 1024, 2048
    x, out = torch.randn(1, k), torch.empty(1, n)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    def best_rate(packed) -> float:
        for _ in range(20):
            _native.packed_linear(out, x, packed)
        best = float("inf")
        for _ in range(200):
            start = time.perf_counter()
            _native.packed_linear(out, x, packed)
            best = min(best, time.perf_counter() - start)
        return n * k / best / 1e9

    cells, int8_cells = [], []
    try:
        for kind in GGUF_BLOCKS:
            blocks = _random_blocks(kind, n, k, rng)
            cells.append(f"{kind} {best_rate(_native.pack_gguf_weight(blocks, k, kind)):5.1f}")
            if _native.int8_dot_supported():
                packed = _native.pack_gguf_weight(blocks, k, kind, int8_activations=True)
                if packed.dtype == torch.int8:
                    int8_cells.append(f"{kind} {best_rate(packed):5.1f}")
    finally:
        torch.set_num_threads(threads)
    print(f"\nin-cache reader rate (1 row, 1 thread, {n} x {k}), G weights/s: " + "  ".join(cells), flush=True)
    if int8_cells:
        print("  the same with int8 activations: " + "  ".join(int8_cells), flush=True)


INT8_SHAPES = {"1.7B gate/up 6144x2048": (6144, 2048), "30B-A3B expert 1536x2048": (1536, 2048)}


def int8_prefill_rate(rows_list: list[int], repeats: int) -> None:
    """G multiply-adds/s of each type's int8-activation kernel at these row counts (x
    quantized per call, as a layer does)."""
    if not rows_list or not _native.int8_dot_supported():
        return
    rng = np.random.default_rng(2)
    print(f"\nint8 activations, G multiply-adds/s by rows ({torch.get_num_threads()} threads)")
    for shape_name, (n, k) in INT8_SHAPES.items():
        print(f"  {shape_name}: " + " ".join(f"{r:>7}" for r in rows_list))
        for kind in GGUF_BLOCKS:
            packed = _native.pack_gguf_weight(_random_blocks(kind, n, k, rng), k, kind, int8_activations=True)
            if packed.dtype != torch.int8:
                continue
            cells = []
            for rows in rows_list:
                x, out = torch.randn(rows, k), torch.empty(rows, n)
                _native.packed_linear(out, x, packed)
                best = float("inf")
                for _ in range(repeats):
                    start = time.perf_counter()
                    _native.packed_linear(out, x, packed)
                    best = min(best, time.perf_counter() - start)
                cells.append(f"{rows * n * k / best / 1e9:7.1f}")
            print(f"    {kind:5}{' ' * max(0, len(shape_name) - 5)}  " + " ".join(cells), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.linear", description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,4,16,64,256,512")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--int8-rows", default="1,8,32,128,512",
                   help="row counts of the int8 prefill table ('' skips it)")
    p.add_argument("--int8-only", action="store_true", help="the int8 prefill table alone")
    p.add_argument("--readers-only", action="store_true", help="the in-cache reader rates alone")
    args = p.parse_args()
    int8_rows = [int(r) for r in args.int8_rows.split(",") if r]
    if args.readers_only:
        reader_rate()
        return
    if args.int8_only:
        int8_prefill_rate(int8_rows, args.repeats)
        return
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    weights = [[torch.randn(n, k) for n, k in SHAPES] for _ in range(LAYERS)]
    variants = {
        "BLAS float32": [[w for w in ws] for ws in weights],
        "packed float32": [[_native.pack_linear_weight(w) for w in ws] for ws in weights],
        "packed bfloat16": [[_native.pack_linear_weight(w.bfloat16()) for w in ws] for ws in weights],
        "packed Q4_1": [[_native.pack_gguf_weight(_q4_1_blocks(n, k, rng), k, "Q4_1") for n, k in SHAPES]
                        for _ in range(LAYERS)],
    }
    if _native.int8_dot_supported():
        variants["Q4_1 int8 activations"] = [[w.view(torch.int8) for w in ws] for ws in variants["packed Q4_1"]]
    variants["BLAS on widened Q4_1"] = variants["packed Q4_1"]
    # --dtype bfloat16 above its row threshold: inputs rounded to bfloat16, oneDNN's GEMM
    # (AMX tiles where the CPU has them), the output widened back to float32
    variants["bfloat16 GEMM"] = [[w.bfloat16() for w in ws] for ws in weights]
    macs = sum(n * k for n, k in SHAPES) * LAYERS
    print(f"{'rows':>5} " + " ".join(f"{name:>22}" for name in variants))
    for rows in (int(r) for r in args.rows.split(",") if r):  # --rows "": the decode table only
        x = {k: torch.randn(rows, k) for k in (576, 1536)}
        cells = []
        for name, layers in variants.items():
            def one_pass():
                for layer in layers:
                    for (n, k), w in zip(SHAPES, layer):
                        if name.startswith("BLAS on"):
                            F.linear(x[k], _native.unpack_linear_weight(w, n))
                        elif name == "bfloat16 GEMM":
                            F.linear(x[k].bfloat16(), w).float()
                        elif name.startswith("BLAS"):
                            F.linear(x[k], w)
                        else:
                            _native.packed_linear(torch.empty(rows, n), x[k], w)
            one_pass()
            start = time.perf_counter()
            for _ in range(args.repeats):
                one_pass()
            seconds = (time.perf_counter() - start) / args.repeats
            cells.append(f"{seconds * 1e3:8.1f} ms {2 * rows * macs / seconds / 1e9:5.0f} GF/s")
        print(f"{rows:>5} " + " ".join(f"{c:>22}" for c in cells), flush=True)
    decode_bandwidth(args.repeats)
    reader_rate()
    int8_prefill_rate(int8_rows, args.repeats)


if __name__ == "__main__":
    main()
