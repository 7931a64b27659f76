"""Speculative decoding (n-gram prompt lookup, greedy verification): the proposer and the
verifier alone, then whole runs of the real engine whose output must equal the same run
without speculation, token for token, across what a step can hold (chunked prompts, prefix
caching, preemption, n > 1, stop strings, max_tokens inside a proposal, requests that are not
speculated beside ones that are), with the books balanced after."""

import json
import re

import pytest
import torch

from pyserve import _native
from pyserve.config import ConfigError, SpeculativeConfig
from pyserve.engine.ngram import LOOKUP_WINDOW, TokenHistory, draft_limit, lookup, next_lookahead, propose
from pyserve.llm import LLM
from pyserve.model.verify import accepted
from pyserve.sampling_params import SamplingParams
from pyserve.sampling_params import StructuredOutputsParams

# at any batch size, so that batches of several requests speculate too
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2, "disable_by_batch_size": None}
REPEATING = ["The capital of France is Paris. The capital of France is",
             "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n",
             "one two three four five six seven one two three four five six seven one two"]


def test_propose_takes_what_followed_the_most_recent_match():
    assert propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2, 2, 3) == [7, 8]
    assert propose([5, 6, 7, 5, 6], 4, 2, 4) == [7, 5, 6]  # runs to the end of the history
    assert propose([1, 2, 3, 4], 3, 1, 3) == []  # no suffix recurs
    assert propose([4, 1, 4], 3, 2, 3) == []  # a 1-gram match is below prompt_lookup_min
    assert propose([4, 1, 4], 3, 1, 3) == [1, 4]
    assert propose([7], 3, 1, 3) == []


def _lookup_by_definition(tokens, min_n, max_n):
    for n in range(max_n, min_n - 1, -1):
        if n > len(tokens) - 1:
            continue
        suffix = tokens[len(tokens) - n:]
        for start in range(len(tokens) - 1 - n, -1, -1):  # the most recent window first
            if tokens[start:start + n] == suffix:
                return start + n, n
    return -1, 0


def _propose_by_definition(tokens, k, min_n, max_n):
    start, n = _lookup_by_definition(tokens, min_n, max_n)
    return tokens[start:start + k] if n else []


def test_propose_equals_its_definition_on_random_histories():
    """Small alphabets repeat often, so the longest-match and most-recent rules are exercised."""
    import random

    rng = random.Random(5)
    for trial in range(3000):
        tokens = [rng.randrange(1 + trial % 6) for _ in range(rng.randrange(0, 40))]
        lo = rng.randrange(1, 4)
        hi = rng.randrange(lo, 6)
        k = rng.randrange(1, 6)
        assert propose(tokens, k, lo, hi) == _propose_by_definition(tokens, k, lo, hi), (tokens, k, lo, hi)
        assert lookup(tokens, lo, hi) == _lookup_by_definition(tokens, lo, hi), (tokens, lo, hi)


def test_lookup_reads_only_the_window():
    """A match older than LOOKUP_WINDOW tokens is not seen (a step's cost stays bounded); one
    inside it is, and the window's edge holds for the match's first token too."""
    filler = [9] * (LOOKUP_WINDOW - 5)  # the history: 5 + filler + 2 = the window + 2 tokens
    assert lookup([1, 2, 0, 0, 0] + filler + [1, 2], 2, 2) == (-1, 0)  # before the window
    assert lookup([0, 0, 1, 2, 0] + filler + [1, 2], 2, 2) == (4, 2)  # its first two tokens
    # the match's first token just outside it: only its last token is seen
    assert lookup([0, 1, 2, 0, 0] + filler + [1, 2], 2, 4) == (-1, 0)
    assert lookup([0, 1, 2, 0, 0] + filler + [1, 2], 1, 4) == (3, 1)


def test_a_short_match_proposes_fewer_drafts():
    """draft_limit: with lookup 2-4, a 2-token match one draft, 3 tokens two, 4 all k."""
    assert [draft_limit(n, 2, 4, 4) for n in (2, 3, 4)] == [1, 2, 4]
    assert draft_limit(2, 2, 4, 1) == 1 and draft_limit(3, 2, 4, 1) == 1  # never above k
    assert draft_limit(5, 5, 5, 4) == 4  # vLLM's default lookup (5 to 5): no limit
    assert [draft_limit(n, 1, 3, 4) for n in (1, 2, 3)] == [1, 2, 4]


@pytest.mark.parametrize("match, drafts", [(2, 1), (3, 2), (4, 4)])
def test_the_scheduler_limits_drafts_by_match_length(match, drafts):
    """A request whose lookahead allows 4 drafts proposes as many as its match earns."""
    from pyserve.config import SchedulerConfig
    from pyserve.engine.request import Request
    from pyserve.engine.scheduler import Scheduler
    from pyserve.kv.manager import KVCacheManager

    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                             speculative_config=SpeculativeConfig(**NGRAM))
    scheduler = Scheduler(config, KVCacheManager(64, 4, enable_prefix_caching=False))
    # the last `match` tokens recur once, after a token that breaks a longer match; 10
    # tokens follow that earlier place
    suffix = list(range(100, 100 + match))
    prompt = [7] + suffix + list(range(200, 210)) + [8] + suffix
    req = Request("r", prompt[:-1], SamplingParams(temperature=0, max_tokens=32), (), 32, arrival=0)
    scheduler.add(req)
    first = scheduler.schedule()  # the prompt but its last token, then that token's step
    scheduler.computed(req, first.sequences[0].num_new_tokens)
    req.append_output(prompt[-1])
    req.lookahead = 4
    step = scheduler.schedule()
    assert step.sequences[0].draft_token_ids == list(range(200, 200 + drafts))



def test_the_growing_history_array_proposes_what_the_list_does():
    """TokenHistory (the scheduler's per-request array) keeps up with a list that grows by
    a token or a few a step, and starts over when handed a shorter one."""
    import random

    rng = random.Random(7)
    history, tokens = TokenHistory(), []
    for step in range(400):
        tokens.extend(rng.randrange(4) for _ in range(rng.randrange(1, 5)))
        array = history.sync(tokens)
        assert array.tolist() == tokens
        assert propose(array, 4, 2, 4) == _propose_by_definition(tokens, 4, 2, 4)
        assert lookup(array, 2, 4) == _lookup_by_definition(tokens, 2, 4)
    assert history.sync(tokens[:5]).tolist() == tokens[:5]


def test_verification_keeps_drafts_while_they_equal_the_argmax():
    assert accepted([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all kept, and the bonus token
    assert accepted([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # the first mismatch ends it
    assert accepted([4, 6, 7, 8], [5, 6, 7]) == [4]  # none kept: one token, as without drafts


def test_the_lookahead_backs_off_and_recovers():
    assert next_lookahead(4, 4, 4, 4) == 4 and next_lookahead(2, 2, 2, 4) == 3
    assert next_lookahead(4, 4, 1, 4) == 2  # one past what paid
    assert next_lookahead(4, 4, 0, 4) == 2 and next_lookahead(1, 1, 0, 4) == 0  # halved, then paused


def test_no_proposals_beyond_the_batch_limit(pair):
    plain, _ = pair
    limited = LLM(None, max_model_len=1024, max_num_batched_tokens=64,
                  speculative_config={**NGRAM, "disable_by_batch_size": 2})
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    limited.generate(REPEATING, params)  # three at once: above the limit
    assert limited.engine.stats.spec_drafts == 0
    limited.generate(REPEATING[:2], params)
    assert limited.engine.stats.spec_drafts > 0
    assert outputs(limited, REPEATING, params) == outputs(plain, REPEATING, params)


def test_a_request_opts_out_or_caps_its_drafts(pair):
    """extra_args {"num_speculative_tokens": n} (the server's vllm_xargs): 0 proposes nothing
    for that request, n caps its drafts a step; the output stays the plain one."""
    plain, spec = pair
    stats = spec.engine.stats
    want = outputs(plain, REPEATING, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for cap in (0, 1, 2):
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True,
                                extra_args={"num_speculative_tokens": cap})
        drafts, proposed = stats.spec_drafts, stats.spec_draft_tokens
        assert outputs(spec, REPEATING, params) == want
        drafts, proposed = stats.spec_drafts - drafts, stats.spec_draft_tokens - proposed
        if cap == 0:
            assert drafts == 0
        else:  # the repeating prompts draft every step they can, never past the cap
            assert drafts > 0 and cap * drafts >= proposed > (cap - 1) * drafts
    for bad, message in (({"typo": 1}, "key 'typo' is not supported"),
                         ({"num_speculative_tokens": -1}, "non-negative integer"),
                         ({"num_speculative_tokens": True}, "non-negative integer")):
        with pytest.raises(ValueError, match=message):
            SamplingParams(extra_args=bad)
    assert_books_balanced(spec)


def test_the_config_is_vllms_json():
    assert SpeculativeConfig.from_json(NGRAM) == SpeculativeConfig("ngram", 4, 4, 2, None)
    assert SpeculativeConfig.from_json({"num_speculative_tokens": 2}).disable_by_batch_size == 4
    # vLLM's lookup lengths: 5 to 5 with neither given, else the one given for both
    for given, want in (({}, (5, 5)), ({"prompt_lookup_max": 3}, (3, 3)),
                        ({"prompt_lookup_min": 2}, (2, 2)),
                        ({"prompt_lookup_min": 2, "prompt_lookup_max": 6}, (2, 6))):
        spec = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 2, **given})
        assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == want
    draft = SpeculativeConfig.from_json({"model": "/d", "num_speculative_tokens": 3})
    assert (draft.method, draft.model, draft.num_speculative_tokens) == ("draft_model", "/d", 3)
    for bad in ({"method": "eagle", "model": "x", "num_speculative_tokens": 2},
                {"method": "draft_model", "num_speculative_tokens": 2},
                {"method": "draft_model", "model": "x", "num_speculative_tokens": 2,
                 "prompt_lookup_max": 3},
                {"method": "ngram"}, {"method": "ngram", "num_speculative_tokens": 0},
                {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5,
                 "prompt_lookup_max": 2},
                {"method": "ngram", "num_speculative_tokens": 2, "typo": 1}):
        with pytest.raises(ConfigError, match="speculative-config"):
            SpeculativeConfig.from_json(bad)


@pytest.fixture(scope="module")
def pair():
    """(plain, speculating) offline engines on the default model."""
    flags = dict(max_model_len=1024, max_num_batched_tokens=32)
    return LLM(None, **flags), LLM(None, speculative_config=NGRAM, **flags)


def outputs(llm, prompts, params):
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs]
            for o in llm.generate(prompts, params)]


def assert_books_balanced(llm):
    # the runner drops a seeded request's generator when a later step hands over its id
    llm.generate([[1, 2]], SamplingParams(temperature=0, max_tokens=1))
    core = llm.engine
    assert not core.has_unfinished() and len(core.requests) == 0
    assert core.kv.num_free_blocks == core.kv.num_blocks
    assert core.executor.runner.num_tracked_requests == 0


def test_greedy_output_is_unchanged_and_drafts_are_accepted(pair):
    plain, spec = pair
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    before = spec.engine.stats.spec_accepted_tokens
    assert outputs(spec, REPEATING, params) == outputs(plain, REPEATING, params)
    assert spec.engine.stats.spec_accepted_tokens > before  # the model repeats: drafts land
    assert_books_balanced(spec)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),  # ends inside a proposal
    SamplingParams(temperature=0, max_tokens=40, stop=["France is"]),
    SamplingParams(temperature=0, max_tokens=24, n=2),
    SamplingParams(temperature=0, max_tokens=24, min_tokens=6),
])
def test_stops_lengths_and_siblings_land_where_they_would(pair, params):
    plain, spec = pair
    assert outputs(spec, REPEATING, params) == outputs(plain, REPEATING, params)
    assert_books_balanced(spec)


def test_requests_that_are_not_speculated_run_beside_those_that_are(pair):
    plain, spec = pair
    params = [SamplingParams(temperature=0, max_tokens=32),
              SamplingParams(temperature=0.8, seed=3, max_tokens=32, presence_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=32, logprobs=2),
              SamplingParams(temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(
                  regex="(Paris ){3}"))]
    prompts = [REPEATING[0]] * 4
    assert ([o.outputs[0].token_ids for o in spec.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in plain.generate(prompts, params)])
    assert_books_balanced(spec)


def test_logprobs_of_speculated_tokens_equal_plain_decodings(pair):
    plain, spec = pair
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=3, ignore_eos=True)
    before = spec.engine.stats.spec_accepted_tokens
    want, got = plain.generate(REPEATING, params), spec.generate(REPEATING, params)
    assert spec.engine.stats.spec_accepted_tokens > before
    for a, b in zip(want, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(b.outputs[0].logprobs) == len(b.outputs[0].token_ids)
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert list(x) == list(y)  # the chosen token first, then the same top 3
            for token in x:
                assert x[token].rank == y[token].rank
                # not bitwise: the two engines' prefix caches differ by this module's earlier
                # tests, so a prompt's uncached part is prefilled in other chunks
                assert x[token].logprob == pytest.approx(y[token].logprob, abs=1e-4)


COPYING = ["The paged KV cache stores keys and values in fixed-size blocks. A block table maps each "
           "sequence's positions to blocks, so sequences grow without copying.\n\nRepeat the text "
           "above exactly.",
           "def area(shape, a):\n    if shape == 'square':\n        return a * a\n    raise "
           "ValueError(shape)\n\nRename the function to shape_area and return the whole code:\n"]


@pytest.mark.skipif(not _native.int8_dot_supported(), reason="needs AVX2 or AVX-512 VNNI")
def test_int8_activations_speculate_exactly_too():
    """--gguf-activations int8 rounds every layer's input to 8 bits, which turns a last-bit
    difference in a row's attention into tenths of a logprob: greedy output and logprobs stay
    those of plain decoding only because a verify step's rows compute bitwise what decode
    steps compute (csrc/cpu/attention.cpp's one-row path for up to 17 rows). One stream at a
    time, as W1 runs: in a batch, speculation moves when other requests' prompts are prefilled,
    in which chunks, and a prefill chunk's rows sum attention in their own order."""
    flags = dict(max_model_len=1024, max_num_batched_tokens=64, gguf_activations="int8")
    plain, spec = LLM(None, **flags), LLM(None, speculative_config=NGRAM, **flags)
    params = SamplingParams(temperature=0, max_tokens=64, logprobs=2, ignore_eos=True)
    prompts = REPEATING + COPYING
    want = [plain.generate([p], params)[0] for p in prompts]
    got = [spec.generate([p], params)[0] for p in prompts]
    assert spec.engine.stats.spec_accepted_tokens > 0
    for a, b in zip(want, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [{t: (lp.rank, lp.logprob) for t, lp in x.items()} for x in a.outputs[0].logprobs] == \
            [{t: (lp.rank, lp.logprob) for t, lp in x.items()} for x in b.outputs[0].logprobs]
    assert_books_balanced(spec)


CONSTRAINTS = [
    StructuredOutputsParams(regex="(Paris, ){5}Paris"),  # drafts the grammar allows
    StructuredOutputsParams(json={"type": "object", "properties": {"city": {"type": "string"},
                                                                   "again": {"type": "string"}},
                                  "required": ["city", "again"]}),
    StructuredOutputsParams(choice=["Paris, Paris, Paris", "Lyon"]),
]


def assert_inside(constraint: StructuredOutputsParams, text: str) -> None:
    """text is one that CONSTRAINTS' constraint allows."""
    if constraint.regex:
        assert re.fullmatch(constraint.regex, text)
    elif constraint.choice:
        assert text in constraint.choice
    else:
        assert set(json.loads(text)) == {"city", "again"}


@pytest.mark.parametrize("constraint", CONSTRAINTS)
def test_grammars_mask_the_drafts_rows(pair, constraint):
    plain, spec = pair
    prompt = "Paris, Paris, Paris, Paris. Answer as asked: Paris, Paris,"
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=constraint),
              SamplingParams(temperature=0.9, seed=5, max_tokens=40, structured_outputs=constraint)]
    want = plain.generate([prompt], params[0])[0].outputs[0].text
    before = spec.engine.stats.spec_drafts
    greedy, sampled = spec.generate([prompt, prompt], params)
    assert greedy.outputs[0].text == want
    assert spec.engine.stats.spec_drafts > before
    assert_inside(constraint, sampled.outputs[0].text)  # sampled under the grammar
    assert_books_balanced(spec)


def test_seeded_sampled_requests_sample_what_they_would_without_speculation(pair):
    plain, spec = pair
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=11, max_tokens=40)
    before = spec.engine.stats.spec_accepted_tokens
    first = outputs(spec, REPEATING, params)
    assert spec.engine.stats.spec_accepted_tokens > before
    # each kept token took the uniform plain sampling would have drawn for it
    assert first == outputs(plain, REPEATING, params)
    assert outputs(spec, REPEATING, params) == first
    assert_books_balanced(spec)


def _rejection_sample(logits, draft, trials, **sampling):
    """The first token of a step with one draft, over many independent trials."""
    from pyserve.model.sampler import build_metadata, draft_verdicts
    from pyserve.step import SamplingInputs

    inputs = SamplingInputs(SamplingParams(**sampling), (), 0)
    meta = build_metadata([inputs] * trials, [None] * trials, logits.shape[-1], torch.device("cpu"))
    accept, drawn = draft_verdicts(logits.expand(trials, -1).clone(), meta,
                                   torch.full((trials,), draft), torch.Generator().manual_seed(0))
    return torch.where(accept, torch.full_like(drawn, draft), drawn)


@pytest.mark.parametrize("sampling, draft", [
    (dict(temperature=1.0), 2), (dict(temperature=0.7), 0),
    (dict(temperature=1.3, top_k=3), 4),  # the draft is outside top-k: never kept
    (dict(temperature=0.9, top_p=0.8, min_p=0.05), 1)])
def test_rejection_sampling_keeps_the_target_distribution(sampling, draft):
    from pyserve.model.sampler import _weights, build_metadata
    from pyserve.step import SamplingInputs

    logits = torch.tensor([[2.0, 1.0, 0.5, -0.5, 0.1, -2.0]])
    trials = 40_000
    tokens = _rejection_sample(logits, draft, trials, **sampling)
    meta = build_metadata([SamplingInputs(SamplingParams(**sampling), (), 0)], [None], 6,
                          torch.device("cpu"))
    weights, _ = _weights(logits, meta)
    want = (weights / weights.sum())[0]
    counts = torch.bincount(tokens, minlength=6).double()
    got = counts / trials
    assert (got - want).abs().max() < 0.012, (got, want)  # ~5 standard errors at 40k trials
    # Pearson's chi-square over the tokens the target can give: below the 0.1 % critical value
    # of its degrees of freedom; tokens it cannot give are never drawn
    possible = want > 0
    assert counts[~possible].sum() == 0
    expected = want[possible] * trials
    chi2 = float(((counts[possible] - expected) ** 2 / expected).sum())
    critical = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}[int(possible.sum()) - 1]
    assert chi2 < critical, (chi2, critical)


def test_prefix_caching_and_preemption_keep_the_output(pair):
    plain, _ = pair
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    prompts = REPEATING * 2  # the second round finds its prompts cached
    want = outputs(plain, prompts, params)
    # room for about two of the six sequences at once: preemptions while drafts are held
    tight = LLM(None, max_model_len=160, max_num_batched_tokens=32, kv_cache_memory=12 * 16 * 30 * 2 * 192 * 4,
                speculative_config=NGRAM)
    assert outputs(tight, prompts, params) == want
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.kv.prefix_hits > 0
    assert_books_balanced(tight)
