"""This machine's ceilings for a model, measured with torch on every core:

- float32 GEMM throughput (GFLOP/s) from a large square matmul: a forward pass costs about
  2 FLOP per parameter per token, so GFLOP/s / (2 * params) bounds tokens/s when compute
  limits (prefill, large batches);
- memory read bandwidth (GB/s) from summing a tensor far larger than the caches: a decode step
  reads every weight once, so bytes of weights / bandwidth bounds the time per step when a
  single stream decodes (no batch to share the reads).

    python -m benchmarks.ceilings [--model DIR] [--json]

The parameter count comes from the model's safetensors headers (SmolLM2-135M: 0.27 GFLOP and
0.54 GB of float32 weights per token). Best of a few timed runs after a warm-up, so a busy
machine reads low rather than high.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time
from pathlib import Path

DEFAULT_MODEL_DIR = Path.home() / ".cache/pyserve/models/SmolLM2-135M-Instruct"
DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I8": 1, "U8": 1}


def _best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: page faults, thread pool start
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def gemm_gflops(n: int = 2048, repeats: int = 5) -> float:
    """float32 GFLOP/s of an n x n x n matmul on all of torch's threads."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    return 2 * n**3 / _best_seconds(lambda: torch.mm(a, b, out=out), repeats) / 1e9


def read_bandwidth_gbs(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """GB/s of reading a float32 tensor of num_bytes once (a sum)."""
    import torch

    x = torch.ones(num_bytes // 4)
    return num_bytes / _best_seconds(lambda: x.sum(), repeats) / 1e9


def model_params(model_dir: Path) -> tuple[int, int]:
    """(parameters, bytes of weights) from the safetensors headers, without loading them."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"no *.safetensors in {model_dir}: pass --model with a model directory")
    params = size = 0
    for path in files:
        with open(path, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for dim in entry["shape"]:
                count *= dim
            params += count
            size += count * DTYPE_BYTES.get(entry["dtype"], 4)
    return params, size


def gguf_params(path: Path) -> tuple[int, int]:
    """(parameters a decode token uses, bytes it reads) of a GGUF file: a mixture of experts'
    active share only (pyserve.model.gguf.decode_read_bytes)."""
    from pyserve.model.gguf import decode_read_bytes, tensor_index

    meta, index = tensor_index(path)
    arch = meta.get("general.architecture")
    experts, used = meta.get(f"{arch}.expert_count") or 0, meta.get(f"{arch}.expert_used_count") or 0
    params = 0
    for name, _, dims, _ in index:
        count = 1
        for d in dims:
            count *= int(d)
        if name == "token_embd.weight":
            continue  # a lookup, no FLOPs
        params += count * used // experts if "_exps." in name and experts else count
    return params, decode_read_bytes(path)[0]


def measure(model_dir: Path = DEFAULT_MODEL_DIR) -> dict:
    """The figures run.py stores: machine ceilings and what they allow this model (a model
    directory's safetensors, or a GGUF file: its active parameters and the bytes a decode
    token reads)."""
    import torch

    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    gflops, gbs = gemm_gflops(), read_bandwidth_gbs()
    params, weight_bytes = (gguf_params(model_dir) if model_dir.suffix == ".gguf"
                            else model_params(model_dir))
    gflop_per_token = 2 * params / 1e9
    gb_per_token = weight_bytes / 1e9
    return {"threads": threads, "gemm_gflops": gflops, "read_bandwidth_gbs": gbs,
            "model": str(model_dir), "params": params, "gflop_per_token": gflop_per_token,
            "weight_gb_per_decode_token": gb_per_token,
            "max_tokens_per_s_compute": gflops / gflop_per_token,
            "min_ms_per_token_single_stream": gb_per_token / gbs * 1000}


def describe(c: dict) -> str:
    return "\n".join([
        f"float32 GEMM ({c['threads']} threads): {c['gemm_gflops']:.1f} GFLOP/s",
        f"memory read bandwidth: {c['read_bandwidth_gbs']:.1f} GB/s",
        f"model: {c['params'] / 1e6:.1f} M parameters, {c['gflop_per_token']:.2f} GFLOP/token, "
        f"{c['weight_gb_per_decode_token']:.2f} GB of weights read per decode step",
        f"ceilings: at most {c['max_tokens_per_s_compute']:.0f} tokens/s when compute-bound; "
        f"at least {c['min_ms_per_token_single_stream']:.1f} ms/token for one stream "
        f"(at most {1000 / c['min_ms_per_token_single_stream']:.0f} tokens/s)"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ceilings",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR,
                   help="model directory with *.safetensors, or a .gguf file (default: the default model)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args(argv)
    c = measure(args.model)
    print(json.dumps(c, indent=2) if args.json else describe(c))
    return 0


if __name__ == "__main__":
    sys.exit(main())
