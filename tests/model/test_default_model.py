"""The default model (SmolLM2-135M-Instruct, converted from its GGUF) against transformers on
the same weights in float32: greedy token ids identical for 8 varied prompts run as one batch."""

import pytest

from pyserve import LLM, SamplingParams
from pyserve.tokenizer.tokenizer import apply_chat_template

from .reference import hf_greedy, load_hf

pytestmark = pytest.mark.slow

LONG = ("Continuous batching schedules requests at the granularity of single steps, so that a "
        "request can join the running batch as soon as another leaves it. ") * 12


def conversations():
    return [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "You are a terse assistant."},
         {"role": "user", "content": "Name three primary colours."},
         {"role": "assistant", "content": "Red, blue and yellow."},
         {"role": "user", "content": "And the secondary ones?"}],
        [{"role": "user", "content": "Write a haiku about paged memory."}],
        [{"role": "user", "content": "Summarise this: " + LONG}],
    ]


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(str(default_model_dir), max_num_batched_tokens=512)


def test_batch_of_eight_matches_transformers(llm, default_model_dir):
    tok = llm.get_tokenizer()
    prompts = [
        "Hi",
        "The three laws of thermodynamics are",
        "def fibonacci(n):\n    ",
        LONG + "In short,",
    ]
    prompt_ids = [tok.encode(p) for p in prompts]
    prompt_ids += [apply_chat_template(tok, c) for c in conversations()]
    assert len(prompt_ids) == 8 and max(map(len, prompt_ids)) > 300
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)

    hf = load_hf(default_model_dir)
    for ids, out in zip(prompt_ids, outputs):
        assert len(out.outputs[0].token_ids) == 64
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, 64)


def test_chat_answer_is_coherent(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=32))[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # the model ends its answer with <|im_end|>
