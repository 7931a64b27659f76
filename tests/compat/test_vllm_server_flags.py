"""vLLM's server flags behind the request details, against a server started as `vllm serve`
would be by default except for --return-tokens-as-token-ids: logprob tokens named by id unless
a request says otherwise, whole-vocabulary logprobs refused under the default --max-logprobs
(20) naming the field, and no prompt_tokens_details without --enable-prompt-tokens-details."""

import openai
import pytest

from tests.e2e.server import ServerProcess

from .wire import post, stream

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(default_model_dir):
    srv = ServerProcess("--served-model-name", MODEL, "--return-tokens-as-token-ids")
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_the_server_flag_names_logprob_tokens_by_id(server, client):
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, logprobs=1,
                                    temperature=0, extra_body={"return_token_ids": True})
    assert out.choices[0].logprobs.tokens == [f"token_id:{t}" for t in out.choices[0].token_ids]
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=1)
    assert all(c.token.startswith("token_id:") for c in chat.choices[0].logprobs.content)
    chunks = stream(server, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES,
                                                     "max_tokens": 3, "logprobs": True})
    streamed = [c for chunk in chunks[1:] for c in chunk["choices"][0]["logprobs"]["content"]]
    assert len(streamed) == 3 and all(c["token"].startswith("token_id:") for c in streamed)
    # a request's own false wins over the flag
    text = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, logprobs=1,
                                     temperature=0,
                                     extra_body={"return_tokens_as_token_ids": False})
    assert "".join(text.choices[0].logprobs.tokens) == text.choices[0].text


def test_whole_vocabulary_logprobs_need_max_logprobs(client):
    with pytest.raises(openai.BadRequestError, match="greater than max allowed: 20") as exc:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                       logprobs=True, top_logprobs=-1)
    assert exc.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1,
                                  extra_body={"prompt_logprobs": -1})
    assert exc.value.body["param"] == "prompt_logprobs"
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, logprobs=-1)
    assert exc.value.body["param"] == "logprobs"
    ok = client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, logprobs=20)
    assert len(ok.choices[0].logprobs.top_logprobs[0]) >= 20


def test_no_prompt_tokens_details_without_the_flag(server):
    status, out = post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert status == 200
    assert "prompt_tokens_details" in out["usage"] and out["usage"]["prompt_tokens_details"] is None
    chunks = stream(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1,
                                                "stream_options": {"include_usage": True}})
    assert chunks[-1]["usage"] == {"prompt_tokens": 1, "total_tokens": 2, "completion_tokens": 1}
