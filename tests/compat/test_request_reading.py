"""vLLM's reading of request fields and its logprob shapes, without a server: seeds through
the JSON parser, logit_bias keys and values, custom roles, and top_logprobs -1 with tokens
named by id."""

import orjson
import pytest

from pyserve.engine.output import CompletionOutput, Logprob
from pyserve.server.errors import APIError
from pyserve.server.openai.logprobs import choice_logprobs, completion_logprobs
from pyserve.server.openai.messages import template_messages
from pyserve.server.openai.params import sampling_params


class _Tokenizer:
    def decode(self, ids):
        return "".join(f"<{t}>" for t in ids)


@pytest.mark.parametrize("text", ["-9223372036854775809", "9223372036854775808", "1e19",
                                  "-1.0e30", "\"9223372036854775808\""])
def test_seeds_beyond_64_bits_are_refused_as_parsed(text):
    body = orjson.loads(f'{{"seed": {text}}}')  # -2**63 - 1 arrives as the float -2**63
    with pytest.raises(APIError) as exc:
        sampling_params(body, None, False, chat=False)
    assert exc.value.param == "seed"


@pytest.mark.parametrize("text, seed", [("-9223372036854775808", -2**63),
                                        ("9223372036854775807", 2**63 - 1), ("3.0", 3)])
def test_seeds_within_64_bits_are_kept(text, seed):
    assert sampling_params(orjson.loads(f'{{"seed": {text}}}'), None, False, chat=False).seed == seed


def test_logit_bias_is_clamped_and_its_bad_keys_named():
    params = sampling_params({"logit_bias": {"5": 250, "6": -1e9, "7": "1.5"}}, None, False,
                             chat=False)
    assert params.logit_bias == {5: 100.0, 6: -100.0, 7: 1.5}
    with pytest.raises(APIError) as exc:
        sampling_params({"logit_bias": {"bad1": 1, "2": 1, "bad2": 1}}, None, False, chat=False)
    assert "'bad1'" in exc.value.message and "'bad2'" in exc.value.message
    assert exc.value.param == "logit_bias"
    with pytest.raises(APIError) as exc:
        sampling_params({"logit_bias": {"9": "lots"}}, None, False, chat=False)
    assert "token 9" in exc.value.message and exc.value.param == "logit_bias"


def test_any_role_is_the_templates_to_read():
    cleaned = template_messages({"messages": [{"role": "ipython", "content": "1"},
                                              {"role": "observation", "content": [
                                                  {"type": "text", "text": "a"},
                                                  {"type": "text", "text": "b"}]}]})
    assert cleaned == [{"role": "ipython", "content": "1"}, {"role": "observation", "content": "a\nb"}]
    for bad in ({"content": "x"}, {"role": None, "content": "x"}, {"role": "", "content": "x"}):
        with pytest.raises(APIError):
            template_messages({"messages": [bad]})


def _position(chosen: int, vocab: int) -> dict:
    """A position's logprobs as the engine gives them: the chosen token first, then by rank."""
    ranked = {t: Logprob(-float(t), t + 1, f"<{t}>") for t in range(vocab)}
    return {chosen: ranked[chosen], **ranked}


def test_top_logprobs_minus_one_lists_every_token_by_rank():
    out = CompletionOutput(0, "<2>", [2], logprobs=[_position(2, 6)])
    entry = choice_logprobs(out, True, -1, _Tokenizer())["content"][0]
    assert [t["token"] for t in entry["top_logprobs"]] == [f"<{t}>" for t in range(6)]
    assert len(choice_logprobs(out, True, 2, _Tokenizer())["content"][0]["top_logprobs"]) == 2


def test_tokens_named_by_id_keep_their_bytes_and_offsets():
    out = CompletionOutput(0, "<2>", [2], logprobs=[_position(2, 3)])
    entry = choice_logprobs(out, True, 1, _Tokenizer(), as_ids=True)["content"][0]
    # vLLM: the entry is named by id, its bytes are still its text's
    assert entry["token"] == "token_id:2" and entry["bytes"] == list(b"<2>")
    assert entry["top_logprobs"][0] == {"token": "token_id:0", "logprob": -0.0,
                                        "bytes": list(b"token_id:0")}
    lp = completion_logprobs([7, 2], [None, _position(2, 3)], _Tokenizer(), 0, as_ids=True)
    assert lp["tokens"] == ["token_id:7", "token_id:2"] and lp["text_offset"] == [0, 10]
    assert lp["top_logprobs"] == [None, {"token_id:2": -2.0, "token_id:0": -0.0,
                                         "token_id:1": -1.0}]


def test_minus_infinity_is_openais_floor():
    position = {4: Logprob(float("-inf"), 9, "<4>")}
    lp = completion_logprobs([4], [position], _Tokenizer(), 0)
    assert lp["token_logprobs"] == [-9999.0] and lp["top_logprobs"] == [{"<4>": -9999.0}]
