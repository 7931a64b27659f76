"""Per-step cost of the Ray executor's paths at TP=2 on the CPU, against the multiprocess
executor's shared memory (and its pipeline parallelism at PP=2): decode steps of a tiny
random Llama (tools/make_tiny_model.py, so that the step is nearly all overhead: scheduling,
the step broadcast, the all-reduces and the logits gather) through EngineCore.step, one token per sequence per step.

    python -m benchmarks.pp_tp [--batch-sizes 1 64] [--steps 100] [--only PP=2]
                               [--arch llama-hd64 --num-layers 8]

Rows: mp (worker processes, shared memory), ray with shared memory (both ranks on this node),
ray with gloo forced (--ray-collectives gloo: TCP over loopback here, across nodes in a real
deployment), and mp at PP=2 (TP=1 per stage, the same two processes: the step broadcast, the
hidden states and residual to stage 1, the logits back), with each step cut into two
micro-batches so that the stages overlap (--pipeline-micro-batches 2) and without (1, the
default), and the same PP=2 over Ray, with shared memory (both stages on this node) and with
gloo forced (the hop and the logits over TCP, as between nodes). Ray runs a local cluster for
the benchmark, started once. Prints the median and p90
microseconds per decode step, then the PP=2 rows' decode throughput (sequences / median step
time) at the largest batch."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

TP2 = {"tensor_parallel_size": 2}
RAY_PP2 = {"distributed_executor_backend": "ray", "pipeline_parallel_size": 2}
PATHS = [("mp, shared memory", {**TP2, "distributed_executor_backend": "mp"}),
         ("ray, shared memory", {**TP2, "distributed_executor_backend": "ray"}),
         ("ray, gloo", {**TP2, "distributed_executor_backend": "ray", "ray_collectives": "gloo"}),
         ("mp PP=2, 1 micro-batch", {"distributed_executor_backend": "mp", "pipeline_parallel_size": 2,
                                     "pipeline_micro_batches": 1}),
         ("mp PP=2, 2 micro-b.", {"distributed_executor_backend": "mp", "pipeline_parallel_size": 2,
                                  "pipeline_micro_batches": 2}),
         ("ray PP=2, shm, 1 mb", {**RAY_PP2, "pipeline_micro_batches": 1}),
         ("ray PP=2, shm, 2 mb", {**RAY_PP2, "pipeline_micro_batches": 2}),
         ("ray PP=2, gloo, 1 mb", {**RAY_PP2, "pipeline_micro_batches": 1, "ray_collectives": "gloo"}),
         ("ray PP=2, gloo, 2 mb", {**RAY_PP2, "pipeline_micro_batches": 2, "ray_collectives": "gloo"})]
WARMUP_STEPS = 5  # the prefill, then a few decodes


def step_times(core, batch: int, steps: int) -> list[float]:
    from pyserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=WARMUP_STEPS + steps + 1, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for i, request_id in enumerate(ids):
        core.add_request(request_id, [1 + i % 50, 5, 9, 33], params)
    for _ in range(WARMUP_STEPS):
        core.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        core.step()
        times.append((time.perf_counter() - t0) * 1e6)
    for request_id in ids:
        core.abort(request_id)
    while core.has_unfinished():
        core.step()
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--only", default="", help="only the rows whose name contains this")
    p.add_argument("--arch", default="llama", help="tools/make_tiny_model.py's architecture")
    p.add_argument("--num-layers", type=int, default=None,
                   help="layers of the tiny model (more: more work per stage to overlap)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from make_tiny_model import make_tiny_model

    import ray

    from pyserve.config import Config
    from pyserve.engine.core import EngineCore

    model = make_tiny_model(Path(tempfile.mkdtemp(prefix="pp-tp-")), args.arch,
                            num_layers=args.num_layers)
    paths = [(name, flags) for name, flags in PATHS if args.only in name]
    ray.init(include_dashboard=False)  # one local cluster for every ray row
    layers = f", {args.num_layers} layers" if args.num_layers else ""
    print(f"decode step at TP=2 (PP=2 where named), tiny {args.arch}{layers}, {args.steps} steps: "
          "median / p90 µs")
    print(f"{'path':<22}" + "".join(f"{'batch ' + str(b):>20}" for b in args.batch_sizes))
    throughput = {}
    try:
        for name, flags in paths:
            core = EngineCore(Config.from_flat(model=str(model), kv_cache_memory=1 << 24, max_model_len=256,
                                               max_num_batched_tokens=512, **flags))
            try:
                cells = []
                for batch in args.batch_sizes:
                    t = sorted(step_times(core, batch, args.steps))
                    cells.append(f"{statistics.median(t):>9.0f} / {t[int(0.9 * len(t))]:>7.0f}")
                    if "pipeline_parallel_size" in flags:
                        throughput[name] = batch / statistics.median(t) * 1e6
                print(f"{name:<22}" + "".join(f"{c:>20}" for c in cells), flush=True)
            finally:
                core.shutdown()
    finally:
        ray.shutdown()
    for name, rate in throughput.items():
        print(f"{name}: {rate:,.0f} tokens/s decoding {max(args.batch_sizes)} sequences")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
