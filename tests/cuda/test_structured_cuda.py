"""Structured outputs on CUDA: the token bitmask applied to GPU logits (xgrammar's torch op)
equals the CPU kernel's result, and a constrained request's output on CUDA follows its grammar."""

import pytest
import torch

from pyserve import _native
from pyserve.structured.bitmask import apply_bitmask

xgr = pytest.importorskip("xgrammar")  # the GPU machine may lack it (no registry there)
CUDA = torch.cuda.is_available() and _native.built_with_cuda()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs a CUDA device and a CUDA build")]


def test_the_mask_on_cuda_equals_the_cpu_kernel():
    g = torch.Generator().manual_seed(0)
    vocab = 49152
    bitmask = torch.randint(-2**31, 2**31 - 1, (8, (vocab + 31) // 32), generator=g, dtype=torch.int32)
    bitmask[:, ::4] = 0
    logits = torch.randn(8, vocab, generator=g)
    cpu, gpu = logits.clone(), logits.cuda()
    apply_bitmask(cpu, bitmask, [0, 3, 5])
    apply_bitmask(gpu, bitmask, [0, 3, 5])
    assert torch.equal(gpu.cpu(), cpu)


def test_a_constrained_request_on_cuda(tiny_model_factory):
    import re

    from pyserve import LLM, SamplingParams
    from pyserve.sampling_params import StructuredOutputsParams

    llm = LLM(str(tiny_model_factory("llama")), load_format="dummy", device="cuda", max_model_len=128)
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=30,
                            structured_outputs=StructuredOutputsParams(regex="[ab]{3,6}"))
    out = llm.generate([[5, 6, 7]], params)[0].outputs[0]
    if out.finish_reason == "stop":
        assert re.fullmatch("[ab]{3,6}", out.text), out.text
