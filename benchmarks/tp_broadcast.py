"""Per-step cost of shipping a step's inputs from rank 0 to a tensor-parallel worker (TP=2
on the CPU): the StepChannel over the shared-memory communicator, against a real worker
process that receives every step, as the multiprocess executor does.

    python -m benchmarks.tp_broadcast [--batch-sizes 1 64] [--context 512] [--steps 2000]

Each batch size is a decode step (one token per sequence, each with --context tokens of
history, so its block table has context / 16 columns); one more row is a full 2048-token
prefill chunk. Prints microseconds per step on rank 0 (median and p99 of --steps sends) and
the payload size."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import secrets
import statistics
import time

import torch

from pyserve.arith import cdiv

BLOCK = 16


def decode_inputs(batch: int, context: int):
    from pyserve.model.layers.attention import AttentionMetadata
    from pyserve.model.runner import ForwardInputs

    blocks = cdiv(context, BLOCK)
    tables = torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks)
    return ForwardInputs(torch.randint(0, 49152, (batch,)), torch.full((batch,), context - 1),
                         AttentionMetadata(tables[:, -1].long() * BLOCK, tables,
                                           torch.arange(batch + 1, dtype=torch.int32),
                                           torch.full((batch,), context, dtype=torch.int32)),
                         torch.arange(batch))


def prefill_inputs(tokens: int):
    from pyserve.model.layers.attention import AttentionMetadata
    from pyserve.model.runner import ForwardInputs

    blocks = tokens // BLOCK
    tables = torch.arange(blocks, dtype=torch.int32).view(1, blocks)
    return ForwardInputs(torch.randint(0, 49152, (tokens,)), torch.arange(tokens),
                         AttentionMetadata(torch.arange(tokens), tables,
                                           torch.tensor([0, tokens], dtype=torch.int32),
                                           torch.tensor([tokens], dtype=torch.int32)),
                         torch.tensor([tokens - 1]))


def receiver(name: str, slot: int) -> None:
    from pyserve import _native
    from pyserve.executor.step_channel import StepChannel

    comm = _native.ShmCommunicator(name, 1, 2, slot, create=False)
    channel = StepChannel(comm)
    comm.barrier()
    try:
        while True:
            channel.receive()
    except RuntimeError:
        pass  # aborted: the benchmark is over


def measure(channel, inputs, steps: int) -> list[float]:
    for _ in range(50):
        channel.send(inputs)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        channel.send(inputs)
        times.append((time.perf_counter() - t0) * 1e6)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=2000)
    args = p.parse_args(argv)

    from pyserve import _native
    from pyserve.executor.step_channel import StepChannel

    torch.set_num_threads(1)
    slot = 2048 * 576 * 4  # what the executor gives SmolLM2 at --max-num-batched-tokens 2048
    name = f"/pyserve-bench-{os.getpid()}-{secrets.token_hex(4)}"
    comm = _native.ShmCommunicator(name, 0, 2, slot, create=True)
    worker = mp.get_context("spawn").Process(target=receiver, args=(name, slot), daemon=True)
    worker.start()
    comm.barrier()
    comm.unlink()
    channel = StepChannel(comm)
    cases = [(f"decode batch {b} (context {args.context})", decode_inputs(b, args.context))
             for b in args.batch_sizes]
    cases.append(("prefill 2048 tokens", prefill_inputs(2048)))
    print(f"{'step':<34}{'payload B':>10}{'median us':>11}{'p99 us':>9}")
    for label, inputs in cases:
        times = sorted(measure(channel, inputs, args.steps))
        payload = sum(t.numel() * t.element_size() for t in
                      (inputs.input_ids, inputs.positions, inputs.logits_rows, *vars(inputs.meta).values()))
        print(f"{label:<34}{payload:>10}{statistics.median(times):>11.1f}"
              f"{times[int(0.99 * len(times))]:>9.1f}")
    comm.abort()
    worker.join(5)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
