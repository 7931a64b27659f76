"""Speculative decoding with a draft model (vLLM's "draft_model" method), on the default model:
the output equals the same run without speculation, token for token, with a draft that agrees
with the target (the default model itself: nearly every draft is kept) and with one that does
not (a tiny random model with the same vocabulary: nearly every draft is rejected, and the
lookahead backs off); across chunked prompts, prefix caching, preemption, n > 1, stop strings,
max_tokens inside a proposal, logprobs, seeded sampling and grammars; books balanced after."""

import shutil

import pytest

from pyserve.errors import ModelLoadError
from pyserve.llm import LLM
from pyserve.sampling_params import SamplingParams

from .test_speculative import CONSTRAINTS, REPEATING, assert_books_balanced, assert_inside, outputs

FLAGS = dict(max_model_len=1024, max_num_batched_tokens=32)
PROMPTS = REPEATING + ["Tell me a short story about a dragon who"]


K = 4  # num_speculative_tokens


def _spec(draft, k=K):
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k,
            "disable_by_batch_size": None}


@pytest.fixture(scope="module")
def random_draft(default_model_dir, tmp_path_factory):
    """A two-layer random Llama with the default model's vocabulary and tokenizer."""
    import torch
    import transformers

    out = tmp_path_factory.mktemp("random-draft")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=2048)
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, out / name)
    return out


@pytest.fixture(scope="module")
def engines(default_model_dir, random_draft):
    """(plain, agreeing draft, random draft) offline engines on the default model."""
    return (LLM(None, **FLAGS), LLM(None, speculative_config=_spec(default_model_dir), **FLAGS),
            LLM(None, speculative_config=_spec(random_draft), **FLAGS))


def test_greedy_output_is_unchanged_with_either_draft(engines):
    plain, agreeing, rejected = engines
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = outputs(plain, PROMPTS, params)
    stats = agreeing.engine.stats
    before = stats.spec_draft_tokens, stats.spec_accepted_tokens
    assert outputs(agreeing, PROMPTS, params) == want
    proposed, kept = stats.spec_draft_tokens - before[0], stats.spec_accepted_tokens - before[1]
    assert proposed > 40 and kept > 0.9 * proposed  # the target's own argmax, batched otherwise
    assert outputs(rejected, PROMPTS, params) == want
    r = rejected.engine.stats
    assert r.spec_draft_tokens > 0 and r.spec_accepted_tokens < 0.2 * r.spec_draft_tokens
    # the lookahead backed off: far fewer drafts than one per output token
    assert r.spec_drafts < 0.5 * 40 * len(PROMPTS)
    assert_books_balanced(agreeing)
    assert_books_balanced(rejected)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),  # ends inside a proposal
    SamplingParams(temperature=0, max_tokens=40, stop=["France is"]),
    SamplingParams(temperature=0, max_tokens=24, n=2, logprobs=2),
])
def test_stops_lengths_siblings_and_logprobs_land_where_they_would(engines, params):
    plain, agreeing, _ = engines
    want, got = plain.generate(PROMPTS, params), agreeing.generate(PROMPTS, params)
    for a, b in zip(want, got):
        for x, y in zip(a.outputs, b.outputs):
            assert (x.token_ids, x.text, x.finish_reason) == (y.token_ids, y.text, y.finish_reason)
            if params.logprobs:
                for p, q in zip(x.logprobs, y.logprobs):
                    assert list(p) == list(q)
                    for token in p:
                        assert p[token].logprob == pytest.approx(q[token].logprob, abs=1e-4)
    assert_books_balanced(agreeing)


def test_seeded_sampled_requests_sample_what_they_would_without_speculation(engines):
    plain, agreeing, _ = engines
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=32)
    before = agreeing.engine.stats.spec_accepted_tokens
    want = outputs(plain, PROMPTS, params)
    assert outputs(agreeing, PROMPTS, params) == want
    assert agreeing.engine.stats.spec_accepted_tokens > before
    assert_books_balanced(agreeing)


@pytest.mark.parametrize("constraint", CONSTRAINTS)
def test_grammars_constrain_the_drafts_and_the_verify_rows(engines, constraint):
    """The draft proposes within the grammar: with the target itself as the draft, masked as
    the target is, a greedy request keeps every draft until the grammar ends (unmasked, it
    would propose text outside the grammar); the random draft's are mostly rejected by the
    target's masked rows. Greedy output equals plain decoding; a sampled one stays inside
    the grammar."""
    plain, agreeing, rejected = engines
    prompt = "Paris, Paris, Paris, Paris. Answer as asked: Paris, Paris,"
    greedy = SamplingParams(temperature=0, max_tokens=40, structured_outputs=constraint)
    sampled = SamplingParams(temperature=0.9, seed=5, max_tokens=40, structured_outputs=constraint)
    want = plain.generate([prompt], greedy)[0].outputs[0]
    for llm in (agreeing, rejected):
        stats = llm.engine.stats
        before = stats.spec_draft_tokens, stats.spec_accepted_tokens
        got = llm.generate([prompt], greedy)[0].outputs[0]
        assert (got.token_ids, got.text) == (want.token_ids, want.text)
        proposed, kept = stats.spec_draft_tokens - before[0], stats.spec_accepted_tokens - before[1]
        assert proposed > 0  # a request under a grammar was speculated
        if llm is agreeing:  # every draft but those past the grammar's end, in the last step
            assert kept >= proposed - K
        assert_inside(constraint, llm.generate([prompt], sampled)[0].outputs[0].text)
        assert_books_balanced(llm)


def test_a_step_mixing_free_and_constrained_drafts_keeps_each_output(engines):
    """One batch: an unconstrained request drafting first, then a greedy request under a
    grammar with logprobs and a seeded sampled one under another, so that the constrained
    sequences' verify rows sit after another sequence's: each equals its plain decoding."""
    plain, agreeing, rejected = engines
    prompts = [REPEATING[0], "Paris, Paris, Paris, Paris. Answer as asked: Paris, Paris,",
               "Answer in JSON: the capital of France is"]
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, logprobs=2,
                             structured_outputs=CONSTRAINTS[0]),
              SamplingParams(temperature=0.8, seed=11, max_tokens=30,
                             structured_outputs=CONSTRAINTS[1])]
    want = plain.generate(prompts, params)
    for llm in (agreeing, rejected):
        drafted = llm.engine.stats.spec_draft_tokens
        got = llm.generate(prompts, params)
        assert llm.engine.stats.spec_draft_tokens > drafted
        for a, b in zip(want, got):
            x, y = a.outputs[0], b.outputs[0]
            assert (x.token_ids, x.text) == (y.token_ids, y.text)
        for p, q in zip(want[1].outputs[0].logprobs, got[1].outputs[0].logprobs):
            assert list(p) == list(q)
            for token in p:
                assert p[token].logprob == pytest.approx(q[token].logprob, abs=1e-4)
        assert_books_balanced(llm)


def test_prefix_caching_and_preemption_keep_the_output(engines, default_model_dir):
    plain = engines[0]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    prompts = REPEATING * 2  # the second round finds its prompts cached
    want = outputs(plain, prompts, params)
    # room for about two of the six sequences at once: preemptions while drafts are held, and
    # readmitted requests whose draft context starts over
    tight = LLM(None, max_model_len=160, max_num_batched_tokens=32,
                kv_cache_memory=12 * 16 * 30 * 2 * 192 * 4, speculative_config=_spec(default_model_dir))
    assert outputs(tight, prompts, params) == want
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.kv.prefix_hits > 0
    assert tight.engine.stats.spec_accepted_tokens > 0
    assert_books_balanced(tight)


def test_a_draft_with_another_vocabulary_is_refused(tiny_model_factory):
    with pytest.raises(ModelLoadError, match="vocabulary"):
        LLM(None, speculative_config=_spec(tiny_model_factory("llama")), **FLAGS)
