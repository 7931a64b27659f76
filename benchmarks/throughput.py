"""Offline generation throughput: pyserve's LLM against transformers' generate, on the same
prompts and weights, in one run.

    python benchmarks/throughput.py [--model DIR] [--batch-sizes 1 16] [--input-len 128]
                                    [--output-len 128] [--no-hf]
    python -m benchmarks.throughput --dataset-name random|sharegpt|prefix-repetition
                                    [--num-prompts N] [that dataset's flags, as vllm bench]

Each batch size runs one batch of random-token prompts (input-len tokens each) generating
exactly output-len tokens (ignore_eos), after one warm-up. Prints output tokens/s, and the
process's peak resident memory.

With --dataset-name, pyserve alone runs the --num-prompts prompts of that dataset
(benchmarks/datasets.py) as one batch, each to its own output length (ignore_eos), and prints
vLLM's throughput line: requests/s, total tokens/s and output tokens/s (--batch-sizes,
--input-len, --output-len and the transformers baseline, whose batches need equal lengths,
do not apply)."""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

if not __package__:
    # run as a script, sys.path[0] is benchmarks/ itself, whose http.py would shadow the
    # standard library's http (torch imports it): the repository root belongs there instead
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from benchmarks.datasets import SampleRequest, add_dataset_args, sample_requests  # noqa: E402


def random_prompts(vocab_size: int, n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # avoid the lowest ids, which hold special tokens in most vocabularies
    return torch.randint(100, vocab_size, (n, length), generator=gen).tolist()


def run_pyserve(llm, prompts, output_len: int) -> float:
    from pyserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
    return len(prompts) * output_len / elapsed


def run_hf(model, prompts, output_len: int) -> float:
    ids = torch.tensor(prompts)  # equal lengths: no padding needed
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                             min_new_tokens=output_len, do_sample=False, pad_token_id=0)
    elapsed = time.perf_counter() - start
    assert out.shape[1] - ids.shape[1] == output_len
    return len(prompts) * output_len / elapsed


def run_dataset(llm, requests: list[SampleRequest]) -> dict:
    from pyserve import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=r.expected_output_len, ignore_eos=True)
              for r in requests]
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests], params)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(r.prompt_len for r in requests)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"elapsed_time": elapsed, "num_requests": len(requests),
            "total_num_tokens": prompt_tokens + output_tokens,
            "requests_per_second": len(requests) / elapsed,
            "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
            "output_tokens_per_second": output_tokens / elapsed}


def main_dataset(args: argparse.Namespace, model_dir: str) -> None:
    from pyserve import LLM

    llm = LLM(model_dir)
    requests = sample_requests(args, llm.get_tokenizer())
    run_pyserve(llm, random_prompts(llm.engine.vocab_size, 1, 16, 1), 4)  # warm-up
    r = run_dataset(llm, requests)
    print(f"\nOffline throughput, {model_dir}, --dataset-name {args.dataset_name}, "
          f"{r['num_requests']} prompts, {torch.get_num_threads()} threads")
    print(f"Throughput: {r['requests_per_second']:.2f} requests/s, "
          f"{r['tokens_per_second']:.2f} total tokens/s, "
          f"{r['output_tokens_per_second']:.2f} output tokens/s")


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: the default model)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    add_dataset_args(parser, num_prompts=64, dataset_name=None)
    args = parser.parse_args(argv)

    from pyserve import LLM
    from pyserve.cli import parse_config
    from pyserve.model.default_model import ensure_default_model

    model_dir = args.model or str(ensure_default_model(parse_config([]).model.download_dir))
    if args.dataset_name is not None:
        return main_dataset(args, model_dir)
    llm = LLM(model_dir, max_num_seqs=max(args.batch_sizes))
    vocab = llm.engine.vocab_size
    run_pyserve(llm, random_prompts(vocab, 1, 16, 1), 4)  # warm-up
    rows = []
    for bs in args.batch_sizes:
        prompts = random_prompts(vocab, bs, args.input_len, args.seed + bs)
        rows.append(("pyserve", bs, run_pyserve(llm, prompts, args.output_len)))
    rss_pyserve = peak_rss_gib()
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        run_hf(hf, random_prompts(vocab, 1, 16, 1), 4)
        for bs in args.batch_sizes:
            prompts = random_prompts(vocab, bs, args.input_len, args.seed + bs)
            rows.append(("transformers", bs, run_hf(hf, prompts, args.output_len)))

    print(f"\nOffline throughput, {model_dir}, float32, {torch.get_num_threads()} threads, "
          f"{args.input_len} in / {args.output_len} out")
    print(f"{'engine':<14}{'batch':>6}{'output tok/s':>15}")
    for engine, bs, tps in rows:
        print(f"{engine:<14}{bs:>6}{tps:>15.1f}")
    print(f"peak RSS after the pyserve runs: {rss_pyserve:.2f} GiB "
          f"(KV cache pages are reserved lazily; touched pages count)")


if __name__ == "__main__":
    sys.exit(main())
