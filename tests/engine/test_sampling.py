"""Sampling features through the real engine: n completions sharing the prompt's blocks,
logprobs and prompt logprobs equal to transformers' on the same weights."""

import pytest
import torch

from pyserve import LLM, SamplingParams

from tests.model.reference import load_hf

PROMPT = "The quick brown fox jumps over the lazy dog. A paged KV cache stores keys and values"


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), kv_cache_memory="16MiB", max_num_batched_tokens=16)


def test_n_completions_share_the_prompt_blocks(llm):
    kv = llm.engine.kv
    hits_before = kv.prefix_hits
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    out = llm.generate(PROMPT, params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different seeds per completion
    full_blocks = (len(out.prompt_token_ids) - 1) // kv.block_size
    assert full_blocks >= 1 and kv.prefix_hits - hits_before >= 3 * full_blocks * kv.block_size
    again = llm.generate(PROMPT, params)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert kv.num_free_blocks == kv.num_blocks


def test_logprobs_match_transformers(llm, model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)
    out = llm.generate(PROMPT, params)[0]
    completion = out.outputs[0]
    hf = load_hf(model_dir)
    ids = out.prompt_token_ids + completion.token_ids
    with torch.no_grad():
        reference = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    n_prompt = len(out.prompt_token_ids)
    for i, (token, position) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = reference[n_prompt - 1 + i]
        assert list(position)[0] == token and position[token].rank == 1
        assert position[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert set(position) == {token} | set(row.topk(3).indices.tolist())
        assert position[token].decoded_token == llm.get_tokenizer().decode([token])
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == n_prompt
    for p in range(1, n_prompt):
        target = out.prompt_token_ids[p]
        entry = out.prompt_logprobs[p]
        assert entry[target].logprob == pytest.approx(reference[p - 1, target].item(), abs=1e-4)
        assert len(entry) <= 3


def test_logprobs_above_the_cap_are_refused(llm):
    # vLLM's wording
    with pytest.raises(ValueError, match="sample logprobs of 21, which is greater than max allowed: 20"):
        llm.generate(PROMPT, SamplingParams(logprobs=21))
    with pytest.raises(ValueError, match="prompt logprobs of 50, which is greater than max allowed: 20"):
        llm.generate(PROMPT, SamplingParams(prompt_logprobs=50))
