"""The offline LLM as vLLM users call it, on the default model: vLLM's keyword arguments
(use_tqdm, lora_request, the chat ones), its engine arguments that have no use here, its
dtype names and seed=None; the text a stop token leaves (none, unless
include_stop_str_in_output), and cumulative_logprob whenever logprobs are asked for."""

import math

import pytest

from pyserve import LLM, SamplingParams

FRANCE = "The capital of France is"
PERIOD = 30  # "." in SmolLM2's vocabulary: the greedy answer above is " Paris."


@pytest.fixture(scope="module")
def llm(default_model_dir):
    # vLLM engine arguments without a use here are accepted with the CLI's warning
    engine = LLM(str(default_model_dir), trust_remote_code=True, swap_space=4, seed=None,
                 dtype="float", enable_prefix_caching=False)
    yield engine
    engine.shutdown()


def test_a_stop_tokens_text_stays_out_unless_asked_for(llm):
    out = llm.generate(FRANCE, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[PERIOD]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids[-1] == PERIOD and out.stop_reason == PERIOD
    assert out.text == llm.get_tokenizer().decode(out.token_ids[:-1])  # " Paris"
    kept = llm.generate(FRANCE, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[PERIOD],
                                               include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == out.text + "."
    # EOS, shown as text with skip_special_tokens off, ends the answer without its text
    chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0, max_tokens=32, skip_special_tokens=False))[0].outputs[0]
    assert chat.finish_reason == "stop" and chat.token_ids[-1] == llm.get_tokenizer().eos_token_id
    assert "<|im_end|>" not in chat.text and chat.text


def test_cumulative_logprob_when_logprobs_are_asked_for(llm):
    out = llm.generate(FRANCE, SamplingParams(temperature=0, max_tokens=6, logprobs=1))[0].outputs[0]
    chosen = [position[t].logprob for position, t in zip(out.logprobs, out.token_ids)]
    assert math.isclose(out.cumulative_logprob, sum(chosen), rel_tol=1e-9, abs_tol=1e-9)
    assert out.cumulative_logprob < 0
    plain = llm.generate(FRANCE, SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
    assert plain.cumulative_logprob is None and plain.token_ids == out.token_ids


def test_chat_renders_what_the_server_renders(llm):
    greedy = SamplingParams(temperature=0, max_tokens=8)
    parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                                   {"type": "text", "text": "of France?"}]}], greedy)
    joined = llm.chat([{"role": "user", "content": "What is the capital\nof France?"}], greedy)
    assert parts[0].prompt_token_ids == joined[0].prompt_token_ids
    assert parts[0].outputs[0].text == joined[0].outputs[0].text
    # an assistant turn that only calls a tool, then the tool's answer; tools for the template
    calls = llm.chat([{"role": "user", "content": "Add 2 and 3"},
                      {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                          "name": "add", "arguments": "{\"a\": 2, \"b\": 3}"}}]},
                      {"role": "tool", "tool_call_id": "c1", "content": "5"}], greedy,
                     tools=[{"type": "function", "function": {"name": "add", "parameters": {}}}],
                     chat_template_kwargs={"custom_flag": True}, use_tqdm=False)
    assert calls[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"content": "no role"}], greedy)
    # the server's checks: a reserved template name, a tool it cannot read, a content format
    # it does not hand the template
    with pytest.raises(ValueError, match="add_generation_prompt"):
        llm.chat([{"role": "user", "content": "hi"}], greedy,
                 chat_template_kwargs={"add_generation_prompt": False})
    with pytest.raises(ValueError, match=r"tools\[0\]"):
        llm.chat([{"role": "user", "content": "hi"}], greedy, tools=[{"type": "function"}])
    with pytest.raises(ValueError, match="chat_template_content_format"):
        llm.chat([{"role": "user", "content": "hi"}], greedy, chat_template_content_format="openai")


def test_chat_template_and_continuing_the_final_message(llm):
    greedy = SamplingParams(temperature=0, max_tokens=4)
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %} ->"
    out = llm.chat([{"role": "user", "content": "one two"}], greedy, chat_template=template)[0]
    assert out.prompt_token_ids == llm.get_tokenizer().encode("one two ->")
    tok = llm.get_tokenizer()
    prefill = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hello there, my"}]
    cont = llm.chat(prefill, greedy, add_generation_prompt=False, continue_final_message=True)[0]
    assert tok.decode(cont.prompt_token_ids).rstrip().endswith("Hello there, my")
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(prefill, greedy, continue_final_message=True)  # with add_generation_prompt


def test_lora_requests_are_refused_by_name(llm):
    assert llm.generate(FRANCE, SamplingParams(max_tokens=1), lora_request=None)
    for call in (lambda: llm.generate(FRANCE, lora_request=object()),
                 lambda: llm.chat([{"role": "user", "content": "hi"}], lora_request=object()),
                 lambda: llm.embed("hi", lora_request=object())):
        with pytest.raises(ValueError, match="lora_request"):
            call()


def test_an_empty_allowed_token_ids_is_refused_when_added(llm):
    # built as in vLLM, refused with vLLM's words when a request carries it
    with pytest.raises(ValueError, match="allowed_token_ids is not None and empty!"):
        llm.generate("hi", SamplingParams(max_tokens=1, allowed_token_ids=[]), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished()


def test_vllm_names_of_options():
    from pyserve.config import Config

    assert Config.from_flat(dtype="half").model.dtype == "float16"
    assert Config.from_flat(dtype="float").model.dtype == "float32"
    import torch

    assert Config.from_flat(dtype=torch.bfloat16).model.dtype == "bfloat16"
    seeds = {Config.from_flat(seed=None).model.seed for _ in range(3)}
    assert len(seeds) == 3 and all(isinstance(s, int) for s in seeds)  # unseeded: a fresh one
    with pytest.raises(ValueError, match="--device"):  # the CLI's refusal, by name
        LLM(None, device="tpu")
    from pyserve.llm import _vllm_only_flags

    flags = {"enable_lora": False, "enable_sleep_mode": False, "trust_remote_code": False,
             "max_model_len": 64}
    _vllm_only_flags(flags)  # switches given as False are switches not given: no refusal
    assert flags == {"max_model_len": 64}
    with pytest.raises(ValueError, match="--enable-lora"):
        _vllm_only_flags({"enable_lora": True})


def test_vllms_imports_and_sampling_fields():
    from pyserve import (BeamSearchParams, PoolingParams, RequestOutputKind,  # noqa: F401
                         StructuredOutputsParams, TextPrompt, TokensPrompt)

    assert TokensPrompt(prompt_token_ids=[1, 2]) == {"prompt_token_ids": [1, 2]}
    assert TextPrompt(prompt="hi") == {"prompt": "hi"}
    # vLLM's older name for structured outputs
    grammar = StructuredOutputsParams(regex="a+")
    assert SamplingParams(guided_decoding=grammar).structured_outputs == grammar
    assert SamplingParams(best_of=1, detokenize=True, allowed_token_ids=[], bad_words=None)
    for kwargs, name in (({"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
                         ({"bad_words": ["x"]}, "bad_words"), ({"best_of": 3}, "best_of"),
                         ({"detokenize": False}, "detokenize"),
                         ({"logits_processors": [print]}, "logits_processors"),
                         ({"truncate_prompt_tokens": 5}, "truncate_prompt_tokens"),
                         ({"structured_outputs": grammar,
                           "guided_decoding": StructuredOutputsParams(regex="b")}, "guided_decoding")):
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kwargs)


def test_prompt_dicts_as_vllm_types(llm):
    from pyserve import TokensPrompt

    ids = llm.get_tokenizer().encode(FRANCE)
    greedy = SamplingParams(temperature=0, max_tokens=3)
    assert (llm.generate(TokensPrompt(prompt_token_ids=ids), greedy)[0].outputs[0].token_ids
            == llm.generate(FRANCE, greedy)[0].outputs[0].token_ids)


def test_vllms_accessors(llm):
    assert llm.llm_engine.get_tokenizer() is llm.get_tokenizer()
    out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=2))[0]
    assert out.prompt == llm.get_tokenizer().decode(out.prompt_token_ids, skip_special_tokens=False)
    assert "Hi" in out.prompt and out.outputs[0].finished()
    assert llm.embed("Hi")[0].outputs.hidden_size == 576


def test_prompt_fields_pyserve_cannot_honour_are_refused(llm):
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": "Describe the image.", "multi_modal_data": {"image": object()}})
