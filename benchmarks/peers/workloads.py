"""The four workloads, as `benchmarks.serve` (= `vllm bench serve`) arguments. All ignore EOS so
that every server generates exactly the asked output length. Each workload draws its prompts
from its own seeds (seed_base + repeat): W3's prompts have W2's shape, and with W2's seeds they
would be W2's prompts, found whole in any prefix cache that kept them.

- W1 single stream: 128 in, 256 out, one request at a time: per-token latency of one user.
- W2 throughput: 256 in, 128 out, 64 prompts, 16 in flight: batched decoding.
- W3 burst: 64 prompts of W2's shape sent at once with no cap: queueing and admission.
- W4 shared prefix: 64 requests of one 1,024-token prefix plus 64 unique tokens, 64 out,
  16 in flight: what a prefix cache saves (compare pyserve with pyserve-noprefix).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    name: str
    what: str
    num_prompts: int
    output_len: int
    args: tuple[str, ...]  # everything but --num-prompts, --seed and the server's address
    seed_base: int  # repeat r runs with --seed seed_base + r

    def seed(self, repeat: int) -> int:
        return self.seed_base + repeat

    def serve_args(self, num_prompts_scale: float) -> list[str]:
        return [*self.args, "--num-prompts", str(self.prompts(num_prompts_scale))]

    def prompts(self, num_prompts_scale: float) -> int:
        return max(1, round(self.num_prompts * num_prompts_scale))


WORKLOADS = {w.name: w for w in (
    Workload("W1", "single stream: 128 in, 256 out, 1 at a time", 8, 256,
             ("--dataset-name", "random", "--random-input-len", "128",
              "--random-output-len", "256", "--max-concurrency", "1", "--ignore-eos"), 0),
    Workload("W2", "throughput: 256 in, 128 out, 16 at a time", 64, 128,
             ("--dataset-name", "random", "--random-input-len", "256",
              "--random-output-len", "128", "--max-concurrency", "16", "--ignore-eos"), 1000),
    Workload("W3", "burst: 256 in, 128 out, all at once", 64, 128,
             ("--dataset-name", "random", "--random-input-len", "256",
              "--random-output-len", "128", "--request-rate", "inf", "--ignore-eos"), 2000),
    Workload("W4", "shared prefix: 1,024 + 64 in, 64 out, 16 at a time", 64, 64,
             ("--dataset-name", "prefix-repetition", "--prefix-repetition-prefix-len", "1024",
              "--prefix-repetition-suffix-len", "64", "--prefix-repetition-num-prefixes", "1",
              "--prefix-repetition-output-len", "64", "--max-concurrency", "16",
              "--ignore-eos"), 3000),
)}
