"""The batched sampler against transformers' logits processors and plain formulas."""

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from pyserve.model.sampler import _apply_penalties, _draw, _top_k_top_p, build_metadata, sample
from pyserve.sampling_params import SamplingParams
from pyserve.step import SamplingInputs

VOCAB = 64


def request(prompt, output=(), **params):
    """One row's sampling inputs, as the scheduler hands them over (histories always given)."""
    return SamplingInputs(SamplingParams(**params), (2,), len(output), list(prompt), list(output))


def metadata(reqs, vocab=VOCAB, seeded=True):
    """Batched metadata; seeded rows get their own generator (the runner's rule) unless
    seeded is False (all rows then draw from the default generator)."""
    generators = [torch.Generator().manual_seed(r.params.seed)
                  if seeded and r.params.seed is not None else None for r in reqs]
    return build_metadata(reqs, generators, vocab, torch.device("cpu"))


def logits(rows=3, seed=0):
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_repetition_penalty_matches_transformers():
    reqs = [request([5, 6, 7], [8, 5], repetition_penalty=1.3),
            request([1, 2], [3], repetition_penalty=0.7),
            request([9], [], repetition_penalty=1.0)]
    x = logits()
    meta = metadata(reqs)
    ours = _apply_penalties(x, meta.penalties)
    for i, r in enumerate(reqs):
        ids = torch.tensor([r.prompt_token_ids + r.output_token_ids])
        theirs = RepetitionPenaltyLogitsProcessor(r.params.repetition_penalty)(ids, x[i:i + 1].clone())
        torch.testing.assert_close(ours[i:i + 1], theirs)


def test_frequency_and_presence_penalties_follow_the_openai_formula():
    reqs = [request([5, 6], [8, 8, 8, 9], frequency_penalty=0.5, presence_penalty=1.0),
            request([5, 6], [8], frequency_penalty=-1.0)]
    x = logits(2)
    meta = metadata(reqs)
    ours = _apply_penalties(x, meta.penalties)
    expected = x.clone()
    expected[0, 8] -= 3 * 0.5 + 1.0
    expected[0, 9] -= 1 * 0.5 + 1.0
    expected[1, 8] += 1.0  # prompt tokens are not penalised by frequency/presence
    torch.testing.assert_close(ours, expected)


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.8), (10, 0.5), (1, 0.3), (0, 0.999)])
def test_top_k_top_p_keep_what_transformers_keeps(top_k, top_p):
    x = logits(4, seed=top_k)
    reqs = [request([1], temperature=0.7, top_k=top_k, top_p=top_p) for _ in range(4)]
    meta = metadata(reqs)
    ours = _top_k_top_p(x, meta.top_k, meta.top_p)
    theirs = x.clone()
    if top_k:
        theirs = TopKLogitsWarper(top_k)(None, theirs)
    if top_p < 1.0:
        theirs = TopPLogitsWarper(top_p)(None, theirs)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    torch.testing.assert_close(ours[~torch.isinf(ours)], x[~torch.isinf(ours)])


def test_min_p_and_temperature_agree_with_transformers():
    x = logits(1, seed=3)
    r = request([1], temperature=0.5, min_p=0.2, seed=0)
    theirs = MinPLogitsWarper(0.2)(None, TemperatureLogitsWarper(0.5)(None, x.clone()))
    allowed = set(torch.nonzero(~torch.isinf(theirs[0])).flatten().tolist())
    meta = metadata([r], seeded=False)  # draw from the default generator, seeded differently each time
    drawn = {sample(x.clone(), meta, torch.Generator().manual_seed(i)).token_ids[0] for i in range(300)}
    assert drawn <= allowed and len(drawn) > 1


def test_sampling_draws_from_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    x = torch.log(probs).repeat(4000, 1)
    reqs = [request([1], temperature=1.0) for _ in range(4000)]
    meta = metadata(reqs, 4)
    tokens = torch.tensor(sample(x, meta, torch.Generator().manual_seed(0)).token_ids)
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_inverse_cdf_draw_skips_zero_weights():
    weights = torch.tensor([[0.0, 2.0, 0.0, 1.0, 0.0, 1.0, 0.0]]).repeat(8000, 1)
    u = torch.rand(8000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    tokens = _draw(weights, u, torch.full((8000,), 1))
    freq = torch.bincount(tokens, minlength=7).float() / 8000
    assert torch.allclose(freq, torch.tensor([0, 0.5, 0, 0.25, 0, 0.25, 0]), atol=0.02), freq
    # u * total at the very end of the cumulative sum (rounding can get there) lands past the
    # last positive weight: the fallback token is taken, never a zero-weight one
    edge = _draw(weights[:2], torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([3, 3]))
    assert edge.tolist() == [3, 1]


def test_seeded_sampling_is_independent_of_the_batch():
    x = logits(3, seed=5)
    alone = [request([1], temperature=0.9, top_k=20, seed=7)]
    mixed = [request([1], temperature=0.9), request([1], temperature=0.9, top_k=20, seed=7),
             request([1], temperature=0.0)]
    a = sample(x[1:2].clone(), metadata(alone), torch.Generator())
    b = sample(x.clone(), metadata(mixed), torch.Generator().manual_seed(3))
    assert a.token_ids[0] == b.token_ids[1]
    assert b.token_ids[2] == x[2].argmax().item()


def test_logit_bias_and_min_tokens_ban():
    x = torch.zeros(2, VOCAB)
    reqs = [request([1], temperature=0.0, logit_bias={"7": 5.0}),
            request([1], temperature=0.0, min_tokens=3, stop_token_ids=[11])]
    x[1, 2] = 10.0  # EOS would win
    x[1, 11] = 9.0  # then the stop token
    x[1, 12] = 1.0
    meta = metadata(reqs)
    assert sample(x, meta, torch.Generator()).token_ids == [7, 12]


def test_logprobs_are_raw_and_ranked():
    x = logits(2)
    reqs = [request([1], temperature=0.0, logprobs=3), request([1], temperature=0.0, logprobs=1)]
    meta = metadata(reqs)
    out = sample(x, meta, torch.Generator())
    raw = x.log_softmax(-1)
    assert out.token_ids == x.argmax(-1).tolist()
    for i in range(2):
        assert out.logprobs.token_ranks[i] == 1
        assert out.logprobs.token_logprobs[i] == pytest.approx(raw[i].max().item())
        assert out.logprobs.top_ids[i] == raw[i].topk(3).indices.tolist()
