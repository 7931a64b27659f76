"""thinking_token_budget (vLLM's): a reasoning of more tokens than the budget gets its end
marker forced, and nothing else about the request changes. Two ordinary tokens of the default
model stand in for <think> and </think> (as in test_structured.py); the server's route, with
a real --reasoning-parser, is tested in tests/e2e/test_thinking_budget.py."""


import pytest

from pyserve import LLM, SamplingParams
from pyserve.engine.thinking_budget import ThinkingBudget
from pyserve.errors import InvalidRequest
from pyserve.sampling_params import StructuredOutputsParams
from pyserve.structured.bitmask import allow_only, allowing_all

START, END = 7, 9  # the tracker's unit tests' markers


def test_the_tracker_counts_from_the_last_start_in_the_prompt_and_the_output():
    opened = ThinkingBudget(2, START, END, [1, START, 5])  # one token of reasoning so far
    assert opened.thinking and opened.count == 1 and opened.forced_token() is None
    opened.accept(4)
    assert opened.forced_token() == END
    opened.accept(END)
    assert not opened.thinking and opened.forced_token() is None
    opened.accept(4)  # the answer: not counted
    opened.accept(START)  # a new reasoning, counted from zero
    assert opened.thinking and opened.count == 0 and opened.forced_token() is None
    opened.accept(4), opened.accept(4)
    assert opened.forced_token() == END

    closed = ThinkingBudget(0, START, END, [START, 5, END, 6])  # enable_thinking false
    assert not closed.thinking and closed.forced_token() is None
    assert ThinkingBudget(0, START, END, [1, START]).forced_token() == END  # nothing allowed


@pytest.mark.parametrize("token", [0, 31, 63, 99])  # 31 and 63: an int32 word's sign bit
def test_a_forced_row_allows_its_token_alone(token):
    mask = allowing_all(2, 100)
    allow_only(mask, 1, token)
    allowed = [w * 32 + b for w in range(mask.shape[1]) for b in range(32) if int(mask[1, w]) >> b & 1]
    assert allowed == [token] and (mask[0] == -1).all()


def test_the_budget_must_be_minus_one_or_non_negative():
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None
    for bad in (-2, True, 1.5):
        with pytest.raises(InvalidRequest) as exc:
            SamplingParams(thinking_token_budget=bad)
        assert exc.value.param == "thinking_token_budget"


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(str(default_model_dir), kv_cache_memory="64MiB", max_model_len=512)


@pytest.fixture
def markers(llm):
    tok = llm.get_tokenizer()
    start, end = (tok.encode(t, add_special_tokens=False)[0] for t in (" Hmm", " Done"))
    admission = llm.engine.admission
    admission.reasoning_markers = (start, end)
    yield tok, start, end
    admission.reasoning_markers = None


def test_the_end_comes_after_the_budget_and_the_rest_is_greedy_as_ever(llm, markers):
    tok, start, end = markers
    prompt = tok.encode("Let me think about the sky. Hmm", add_special_tokens=False)
    assert prompt[-1] == start  # the prompt opened the reasoning
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    free = llm.generate({"prompt_token_ids": prompt}, greedy)[0].outputs[0].token_ids
    assert end not in free  # the model would not end it by itself
    for budget in (0, 1, 4):
        got = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
            temperature=0.0, max_tokens=12, ignore_eos=True, thinking_token_budget=budget))[0].outputs[0]
        assert got.token_ids[:budget] == free[:budget]
        assert got.token_ids[budget] == end
        # after the forced token, what greedy decoding gives the prompt that ends there
        after = llm.generate({"prompt_token_ids": prompt + got.token_ids[:budget + 1]}, SamplingParams(
            temperature=0.0, max_tokens=12 - budget - 1, ignore_eos=True))[0].outputs[0].token_ids
        assert got.token_ids[budget + 1:] == after


def test_a_new_reasoning_is_counted_again_and_the_mask_beats_a_bias(llm, markers):
    """A bias makes the model open a reasoning at every free token; a budget of 0 ends each
    one at once, and the bias (applied after the mask) cannot undo that."""
    tok, start, end = markers
    got = llm.generate("Colours:", SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True, logit_bias={start: 100.0},
        thinking_token_budget=0))[0].outputs[0].token_ids
    assert got == [start, end] * 4


def test_sampled_completions_each_keep_their_own_count(llm, markers):
    tok, start, end = markers
    prompt = tok.encode("Story time. Hmm", add_special_tokens=False)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        n=3, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True, thinking_token_budget=3))[0]
    for c in out.outputs:
        assert end in c.token_ids[:4]  # its own end, or the forced one at index 3


def test_the_grammar_starts_after_the_forced_end(llm, markers):
    tok, start, end = markers
    prompt = tok.encode("Pick a colour. Hmm", add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=20, thinking_token_budget=2,
                            structured_outputs=StructuredOutputsParams(choice=["red", "blue"]))
    got = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
    assert got.token_ids[2] == end and got.text.split(" Done", 1)[1] in ("red", "blue")
    assert got.finish_reason == "stop"


def test_without_a_reasoning_parser_the_budget_is_refused(llm):
    with pytest.raises(InvalidRequest) as exc:
        llm.generate("Hi", SamplingParams(max_tokens=3, thinking_token_budget=5))
    assert exc.value.param == "thinking_token_budget"
    assert not llm.engine.has_unfinished()


def test_speculation_leaves_a_budgeted_request_as_it_was(default_model_dir, llm, markers):
    """Drafts could run past the budget: a budgeted request takes none, and its tokens are
    those of the engine that does not speculate."""
    tok, start, end = markers
    speculating = LLM(str(default_model_dir), kv_cache_memory="64MiB", max_model_len=512,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                          "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    speculating.engine.admission.reasoning_markers = (start, end)
    prompt = tok.encode("one two three four five six seven one two three four five six seven Hmm one two",
                        add_special_tokens=False)  # two tokens of reasoning already
    for budget in range(2, 10):  # the budget runs out at each place in and between drafts
        params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True,
                                thinking_token_budget=budget)
        want = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
        assert want[budget - 2] == end
        got = speculating.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
        assert got == want, budget
    free = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    speculating.generate({"prompt_token_ids": prompt}, free)
    assert speculating.engine.stats.spec_draft_tokens > 0  # it does speculate on this prompt
    speculating.shutdown()
