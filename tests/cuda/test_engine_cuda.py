"""The whole engine on CUDA: a tiny random Llama through LLM(...) on the GPU against the same
model on the CPU (greedy ids equal, logprobs close), decode steps replayed from the
extension's CUDA graphs against --enforce-eager, the KV cache sized from measured GPU memory,
a clear refusal when the memory is too small, and seeded sampling reproducible on the GPU.

Tolerances: float32 on both devices; logprobs within 1e-3 (cuBLAS and the CPU kernels sum in
different orders, TF32 off)."""

import functools
import gc
import logging
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from pyserve import LLM, SamplingParams, _native
from pyserve.errors import ModelLoadError

CUDA = torch.cuda.is_available() and _native.built_with_cuda()
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not CUDA, reason="needs a CUDA device and a CUDA build of pyserve._C"),
]

PROMPTS = ["Hello, world!", "The quick brown fox jumps over", "Paris is the capital of", "0 1 2 3",
           "a b c", "one two three four five six"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)


# No pytest fixtures: tools/run_cuda_tests.py runs these where pytest is missing.
@functools.cache
def tiny_model_dir() -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    try:
        from make_tiny_model import make_tiny_model
    except ImportError as exc:
        pytest.skip(f"building the tiny model needs {exc.name}")
    # head_dim 64: the CUDA attention kernel has head sizes 64, 128 and 256 only
    return str(make_tiny_model(Path(tempfile.mkdtemp(prefix="pyserve-tiny-")), "llama-hd64"))


def generate(llm: LLM, params=GREEDY):
    outs = llm.generate(PROMPTS, params)
    return ([o.outputs[0].token_ids for o in outs],
            [[next(iter(p.values())).logprob for p in o.outputs[0].logprobs] for o in outs])


@functools.cache
def on_cpu():
    llm = LLM(tiny_model_dir(), device="cpu", dtype="float32", max_model_len=256, kv_cache_memory="16MiB")
    return generate(llm)


class LogLines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_cuda_graphs_and_eager_match_the_cpu():
    log = LogLines()
    logger = logging.getLogger("pyserve")
    logger.addHandler(log)
    logger.setLevel(logging.INFO)
    try:
        graphed = LLM(tiny_model_dir(), device="cuda", dtype="float32", max_model_len=256, max_num_seqs=8,
                      gpu_memory_utilization=0.3)
    finally:
        logger.removeHandler(log)
    text = "\n".join(log.lines)
    runner = graphed.engine.executor.runner
    assert runner.graphs is not None and runner.graphs.sizes == (1, 2, 4, 8)
    assert "GPU memory:" in text and "CUDA graphs: captured 4" in text
    assert runner.num_blocks * 16 >= 256  # measured, and at least one full sequence
    eager = LLM(tiny_model_dir(), device="cuda", dtype="float32", max_model_len=256, enforce_eager=True,
                kv_cache_memory="64MiB")
    assert eager.engine.executor.runner.graphs is None
    cpu_ids, cpu_lp = on_cpu()
    for name, llm in (("graphs", graphed), ("eager", eager)):
        ids, lp = generate(llm)
        assert ids == cpu_ids, name
        for a, b in zip(lp, cpu_lp):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-3, rtol=1e-3)
    del graphed, eager, runner
    gc.collect()
    torch.cuda.empty_cache()  # the next tests measure the device again


def test_bfloat16_default_dtype_runs_and_mostly_agrees():
    llm = LLM(tiny_model_dir(), device="cuda", max_model_len=256, max_num_seqs=8, kv_cache_memory="64MiB")
    assert llm.engine.dtype == torch.bfloat16
    ids, _ = generate(llm)
    cpu_ids, _ = on_cpu()
    first = [a[0] == b[0] for a, b in zip(ids, cpu_ids)]
    assert sum(first) >= len(first) - 1  # bfloat16 may flip a near-tie, not most tokens


def test_too_little_memory_is_a_clear_error():
    with pytest.raises(ModelLoadError, match="--gpu-memory-utilization"):
        LLM(tiny_model_dir(), device="cuda", dtype="float32", max_model_len=256, gpu_memory_utilization=0.001)


def test_seeded_sampling_is_reproducible_on_the_gpu():
    llm = LLM(tiny_model_dir(), device="cuda", dtype="float32", max_model_len=256, max_num_seqs=8,
              kv_cache_memory="64MiB")
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=7, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[::-1], params)][::-1]
    assert first == again  # a seeded request's tokens do not depend on the rest of the batch
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    assert all(len(o.outputs[0].token_ids) == 16 for o in llm.generate(PROMPTS, unseeded))


def test_async_engine_awaits_the_stream_and_matches_the_offline_engine():
    """The server's path on CUDA: steps queued on a stream, awaited through the eventfd the
    stream writes (no thread blocked on the device), results equal to the offline engine's."""
    import asyncio

    from pyserve.engine.async_engine import AsyncEngine

    llm = LLM(tiny_model_dir(), device="cuda", dtype="float32", max_model_len=256, max_num_seqs=8,
              kv_cache_memory="64MiB")
    assert llm.engine.launches_async
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    prompts = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    offline = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    expected = [(o.outputs[0].token_ids, [sorted(lp) for lp in o.outputs[0].logprobs]) for o in offline]

    async def main():
        engine = AsyncEngine(llm.engine)

        async def one(i, ids):
            final = None
            async for out in engine.generate(ids, params, f"async-{i}"):
                final = out
            return final.outputs[0].token_ids, [sorted(lp) for lp in final.outputs[0].logprobs]

        try:
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        finally:
            await engine.shutdown()

    assert asyncio.run(main()) == expected
