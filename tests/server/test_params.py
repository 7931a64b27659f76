"""Request bodies -> SamplingParams as vLLM's protocol models read them."""

import pytest

from pyserve.server.errors import APIError
from pyserve.server.openai.params import requested_max_tokens, sampling_params


def test_max_tokens_defaults_per_endpoint():
    assert requested_max_tokens({}, chat=False) == 16  # OpenAI's and vLLM's completions default
    assert requested_max_tokens({"max_tokens": None}, chat=False) == 16  # null is the default too
    assert requested_max_tokens({}, chat=True) is None
    assert requested_max_tokens({"max_completion_tokens": None, "max_tokens": 7}, chat=True) == 7
    assert requested_max_tokens({"max_completion_tokens": 3, "max_tokens": 7}, chat=True) == 3


def test_model_defaults_fill_what_the_request_leaves_out():
    defaults = {"temperature": 0.6, "top_p": 0.9, "presence_penalty": 0.5, "max_tokens": 100}
    params = sampling_params({"top_p": 0.5}, None, False, chat=True, defaults=defaults)
    assert (params.temperature, params.top_p, params.presence_penalty, params.max_tokens) == (0.6, 0.5, 0.5, 100)
    # max_new_tokens only stands in for a missing limit, as vLLM's get_max_tokens
    assert sampling_params({"max_tokens": 500}, None, False, chat=True, defaults=defaults).max_tokens == 500
    assert sampling_params({}, None, False, chat=False, defaults=defaults).max_tokens == 16


def test_lax_types_as_pydantic_reads_them():
    params = sampling_params({"n": 2.0, "top_k": " +5", "temperature": 1, "ignore_eos": "yes",
                              "seed": -3, "stop_token_ids": ["7", 8.0]}, None, False, chat=False)
    assert (params.n, params.top_k, params.temperature, params.ignore_eos, params.seed) == (2, 5, 1.0, True, -3)
    assert params.stop_token_ids == [7, 8]


@pytest.mark.parametrize("body, param", [
    ({"n": 1.5}, "n"), ({"top_k": True}, "top_k"), ({"seed": 2**63}, "seed"),
    ({"temperature": "hot"}, "temperature"), ({"logit_bias": [1]}, "logit_bias"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids"), ({"ignore_eos": "maybe"}, "ignore_eos"),
    ({"max_tokens": "+-1"}, "max_tokens"), ({"stop_token_ids": ["\u00b2"]}, "stop_token_ids"),
])
def test_wrong_types_are_400s_naming_the_field(body, param):
    with pytest.raises(APIError) as exc:
        sampling_params(body, None, False, chat=False)
    assert exc.value.status == 400 and exc.value.param == param
