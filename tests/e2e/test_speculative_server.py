"""A server with --speculative-config (n-gram lookup, and a draft model: the default model
drafting for itself): greedy completions (streamed and not) equal the same requests decoded
without speculation (the offline engine), and vLLM's spec_decode counters move on /metrics."""

import json
import re
import urllib.request

import openai
import pytest

from pyserve.llm import LLM
from pyserve.sampling_params import SamplingParams

from .server import ServerProcess

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is Paris. The capital of France is"
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                   "prompt_lookup_min": 2})


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def server(request, default_model_dir):
    spec = SPEC if request.param == "ngram" else json.dumps(
        {"method": "draft_model", "model": str(default_model_dir), "num_speculative_tokens": 3})
    srv = ServerProcess("--speculative-config", spec, "--max-model-len", "1024")
    yield srv
    assert srv.stop() == 0


def test_speculated_completions_equal_plain_decoding(server):
    want = LLM(None, max_model_len=1024).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0].text
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    args = dict(model="", prompt=PROMPT, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    assert client.completions.create(**args).choices[0].text == want
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **args))
    assert streamed == want
    with urllib.request.urlopen(server.url + "/metrics") as r:
        text = r.read().decode()
    accepted = re.search(r'^vllm:spec_decode_num_accepted_tokens_total\{[^}]*\} (\S+)', text, re.M)
    drafts = re.search(r'^vllm:spec_decode_num_drafts_total\{[^}]*\} (\S+)', text, re.M)
    assert accepted and drafts and float(accepted.group(1)) > 0 and float(drafts.group(1)) > 0
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{' in text


def test_vllm_xargs_opt_a_request_out(server):
    """vllm_xargs {"num_speculative_tokens": 0}: the request proposes no draft (the drafts
    counter stays), and its text is the plain one; a key pyserve does not read is a 400."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    args = dict(model="", prompt=PROMPT, max_tokens=24, temperature=0)
    want = client.completions.create(**args).choices[0].text

    def drafts() -> float:
        with urllib.request.urlopen(server.url + "/metrics") as r:
            text = r.read().decode()
        return float(re.search(r'^vllm:spec_decode_num_drafts_total\{[^}]*\} (\S+)', text, re.M).group(1))

    before = drafts()
    out = client.completions.create(extra_body={"vllm_xargs": {"num_speculative_tokens": 0}}, **args)
    assert out.choices[0].text == want and drafts() == before
    for bad in ({"typo": 1}, {"num_speculative_tokens": "many"}, ["num_speculative_tokens"]):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=4, extra_body={"vllm_xargs": bad})
        assert err.value.body["param"] == "vllm_xargs" and "vllm_xargs" in err.value.body["message"]
