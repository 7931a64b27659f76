"""thinking_token_budget through the openai SDK, with --reasoning-parser deepseek_r1 on a tiny
random model whose tokenizer has <think> and </think> as tokens of their own and whose chat
template opens the reasoning (as DeepSeek-R1's does). After the budget the server forces
</think>: the reasoning holds exactly the budget's tokens, the answer follows."""

import shutil

import openai
import pytest

from .server import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "tiny-thinker"
BUDGET = 3


@pytest.fixture(scope="module")
def thinker(tiny_model_factory, tmp_path_factory):
    from transformers import AutoTokenizer

    src = tiny_model_factory("llama")
    model = tmp_path_factory.mktemp("tiny-thinker")
    for f in src.iterdir():
        shutil.copy(f, model / f.name)
    tok = AutoTokenizer.from_pretrained(str(src))
    tok.add_tokens(["<think>", "</think>"])  # ids 440 and 441 of the model's 512
    tok.chat_template = tok.chat_template + "{% if add_generation_prompt %}<think>{% endif %}"
    tok.save_pretrained(str(model))
    srv = ServerProcess("--model", str(model), "--served-model-name", MODEL,
                        "--reasoning-parser", "deepseek_r1")
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0), tok
    assert srv.stop() == 0


def _chat(client, **extra):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello, world!"}], temperature=0,
        max_tokens=10, logprobs=True, **extra)


def test_the_reasoning_ends_after_the_budget(thinker):
    thinker, tok = thinker
    end = tok.convert_tokens_to_ids("</think>")
    free = _chat(thinker, extra_body={"return_token_ids": True}).choices[0].token_ids
    assert end not in free  # the random model never ends it by itself
    got = _chat(thinker, extra_body={"thinking_token_budget": BUDGET, "return_token_ids": True}).choices[0]
    assert got.token_ids[:BUDGET] == free[:BUDGET] and got.token_ids[BUDGET] == end
    assert got.logprobs.content[BUDGET].logprob == 0.0  # the only token the row allowed
    assert got.message.reasoning == tok.decode(got.token_ids[:BUDGET])
    assert got.message.content == tok.decode(got.token_ids[BUDGET + 1:])

    streamed = {"reasoning": "", "content": ""}
    for chunk in thinker.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hello, world!"}], temperature=0,
            max_tokens=10, stream=True, extra_body={"thinking_token_budget": BUDGET}):
        if chunk.choices:
            delta = chunk.choices[0].delta
            streamed["reasoning"] += getattr(delta, "reasoning", None) or ""
            streamed["content"] += delta.content or ""
    assert streamed == {"reasoning": got.message.reasoning, "content": got.message.content}


def test_completions_count_the_prompts_open_reasoning(thinker):
    thinker, tok = thinker
    prompt = "Hi <think> ok"
    ids = tok.encode(prompt, add_special_tokens=False)
    already = len(ids) - ids.index(tok.convert_tokens_to_ids("<think>")) - 1  # " ok"'s tokens
    assert 0 < already < BUDGET
    out = thinker.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=6,
                                     logprobs=1, extra_body={"thinking_token_budget": BUDGET})
    tokens = out.choices[0].logprobs.tokens
    assert tokens.index("</think>") == BUDGET - already


def test_a_negative_budget_is_refused_by_name(thinker):
    thinker, _ = thinker
    with pytest.raises(openai.BadRequestError) as exc:
        _chat(thinker, extra_body={"thinking_token_budget": -5})
    assert exc.value.body["param"] == "thinking_token_budget"
