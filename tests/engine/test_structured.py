"""Structured outputs in the offline engine: vLLM's StructuredOutputsParams on SamplingParams,
each of n completions with its own matcher, preemption (recompute) keeping the grammar's
state, constrained and free requests in one batch, and bad grammars refused at admission."""

import json
import re

import jsonschema
import pytest

from pyserve import LLM, SamplingParams
from pyserve.errors import InvalidRequest
from pyserve.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 1, "maximum": 999},
    "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "minItems": 1, "maxItems": 3}},
    "required": ["id", "tags"]}
PROMPTS = [f"Record number {i} as JSON:" for i in range(8)]
BLOCK_BYTES = 2 * 30 * 3 * 64 * 16 * 4  # K+V x 30 layers x 3 KV heads x head 64 x 16 tokens x fp32


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(str(default_model_dir), kv_cache_memory="64MiB", max_model_len=512)


def constrained(**kwargs):
    return SamplingParams(max_tokens=80, structured_outputs=StructuredOutputsParams(json=SCHEMA), **kwargs)


def test_n_completions_each_follow_the_grammar(llm):
    out = llm.generate(PROMPTS[0], constrained(n=3, temperature=1.0, seed=2))[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert len({c.text for c in out.outputs}) > 1  # three draws, not one matcher shared


def test_constrained_and_free_requests_share_a_batch(llm):
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(PROMPTS[1], free)[0].outputs[0].token_ids
    mixed = llm.generate(PROMPTS[:4], [constrained(temperature=0.0), free,
                                       constrained(temperature=1.0, seed=4), free])
    assert mixed[1].outputs[0].token_ids == alone  # the grammar rows do not touch the others
    for i in (0, 2):
        jsonschema.validate(json.loads(mixed[i].outputs[0].text), SCHEMA)


def test_preemption_keeps_the_grammar_and_the_output(default_model_dir, llm):
    small = LLM(str(default_model_dir), kv_cache_memory=16 * BLOCK_BYTES, max_model_len=256)
    params = constrained(temperature=0.0)
    prompts = [f"{p} " + "Numbers and words, " * 12 for p in PROMPTS]  # about 60 tokens each
    got = small.generate(prompts, params)
    assert small.engine.scheduler.num_preemptions > 0
    want = llm.generate(prompts, params)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    for o in got:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    assert small.engine.kv.num_free_blocks == small.engine.kv.num_blocks


@pytest.mark.parametrize("spec, check", [
    (StructuredOutputsParams(regex=r"\d{4}-\d{2}"), lambda t: re.fullmatch(r"\d{4}-\d{2}", t)),
    (StructuredOutputsParams(choice=["left", "right"]), lambda t: t in ("left", "right")),
    (StructuredOutputsParams(grammar='root ::= ("ab" | "cd")+'), lambda t: re.fullmatch("(ab|cd)+", t)),
    (StructuredOutputsParams(json_object=True), lambda t: isinstance(json.loads(t), dict)),
])
def test_each_kind_of_constraint(llm, spec, check):
    params = SamplingParams(temperature=1.0, seed=9, max_tokens=60, structured_outputs=spec)
    out = llm.generate("Go:", params)[0].outputs[0]
    if out.finish_reason == "stop":
        assert check(out.text), out.text


def test_a_completed_grammar_ends_the_request_even_with_ignore_eos(llm):
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=["done"]))
    out = llm.generate("Say:", params)[0].outputs[0]
    assert out.text.startswith("done") and out.finish_reason == "stop"


def test_bad_grammars_are_refused_and_the_engine_goes_on(llm):
    for spec in (StructuredOutputsParams(regex="(unclosed"),
                 StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": 7}}}),
                 StructuredOutputsParams(grammar="root ::= nowhere")):
        with pytest.raises(InvalidRequest) as exc:
            llm.generate("x", SamplingParams(max_tokens=4, structured_outputs=spec))
        assert exc.value.param == "structured_outputs"
    with pytest.raises(InvalidRequest):
        StructuredOutputsParams(regex="a", choice=["b"])
    assert llm.generate("Hi", SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids
    assert not llm.engine.has_unfinished()


def test_with_a_reasoning_model_the_grammar_starts_after_the_reasoning(llm):
    """Two ordinary tokens stand in for <think> and </think>: the first sampled token is
    pushed to the end marker (which the choice grammar alone would never allow); after it,
    the grammar holds. A prompt that already closed the reasoning starts constrained."""
    tok = llm.get_tokenizer()
    start, end = tok.encode(" Hmm", add_special_tokens=False)[0], tok.encode(" Done", add_special_tokens=False)[0]
    admission = llm.engine.admission
    admission.reasoning_markers = (start, end)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=20, logit_bias={end: 100.0},
                                structured_outputs=StructuredOutputsParams(choice=["red", "blue"]))
        out = llm.generate("Colour:", params)[0].outputs[0]
        assert out.token_ids[0] == end and out.text.split(" Done", 1)[1] in ("red", "blue")
        closed = tok.encode("Colour: Hmm Done", add_special_tokens=False)
        out = llm.generate({"prompt_token_ids": closed}, params)[0].outputs[0]
        assert out.text in ("red", "blue")  # the bias cannot break the grammar now
    finally:
        admission.reasoning_markers = None
