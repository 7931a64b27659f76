"""The CPU linear layers of SmolLM2-135M's 30 decoder layers (qkv, o, gate/up and down
projections) at a range of row counts: BLAS (torch's F.linear) on float32 weights against our
packed kernel (csrc/cpu/linear.cpp) on float32, bfloat16 and GGUF Q4_1 weights, Q4_1 with
int8 activations (--gguf-activations int8, where the CPU has AVX-512 VNNI), and BLAS on the
packed weight widened back (what apply_linear does above PACKED_MAX_ROWS).

    python -m benchmarks.linear [--rows 1,4,16,64,256,512] [--repeats 5]

Prints milliseconds per pass over all 30 layers and the GFLOP/s that is (2 · rows · 106 M
multiply-adds); the random weights and quants have the real shapes, so the times are the
model's.
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


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.linear", description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,4,16,64,256,512")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
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
    macs = sum(n * k for n, k in SHAPES) * LAYERS
    print(f"{'rows':>5} " + " ".join(f"{name:>22}" for name in variants))
    for rows in (int(r) for r in args.rows.split(",")):
        x = {k: torch.randn(rows, k) for k in (576, 1536)}
        cells = []
        for name, layers in variants.items():
            def one_pass():
                for layer in layers:
                    for (n, k), w in zip(SHAPES, layer):
                        if name.startswith("BLAS on"):
                            F.linear(x[k], _native.unpack_linear_weight(w, n))
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


if __name__ == "__main__":
    main()
