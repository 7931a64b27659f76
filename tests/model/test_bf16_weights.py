"""bfloat16 weight storage on the CPU (--dtype bfloat16: float32 activations, weights widened
in registers) against the float32 model on the default model's chat prompts: the first tokens
agree and every chosen token's logprob stays close to float32's."""

import pytest
import torch

from pyserve import LLM, SamplingParams

from .test_default_model import conversations

pytestmark = pytest.mark.slow


def test_bf16_weights_stay_close_to_float32(default_model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=0, ignore_eos=True)
    full = LLM(str(default_model_dir), dtype="float32", max_num_batched_tokens=512)
    narrow = LLM(str(default_model_dir), dtype="bfloat16", max_num_batched_tokens=512)
    assert narrow.engine.executor.runner.model.lm_head.weight.dtype == torch.bfloat16
    assert narrow.engine.dtype == torch.float32  # activations and KV cache
    for conversation in conversations():
        a = full.chat(conversation, params)[0].outputs[0]
        b = narrow.chat(conversation, params)[0].outputs[0]
        assert a.token_ids[:4] == b.token_ids[:4]
        agree = 0
        for ta, tb, la, lb in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs):
            if ta != tb:
                break
            agree += 1
            # the same token, nearly the same probability
            assert abs(la[ta].logprob - lb[tb].logprob) < 0.1
        assert agree >= 4
