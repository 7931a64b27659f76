"""The native sampler (_native.sample_tokens) against the PyTorch steps it replaces on the CPU
(sampler._weights and sampler._draw, which CUDA still runs): greedy rows bitwise equal to
torch.argmax; a random row the same token as the reference wherever the uniform is not within
rounding of a boundary of the reference's CDF; never a token of weight 0."""

from __future__ import annotations

import pytest
import torch

from pyserve import _native
from pyserve.model.sampler import SamplingMetadata, _draw, _weights


def _meta(S, temperature, min_p=None, top_k=None, top_p=None):
    return SamplingMetadata(
        temperature=torch.full((S,), temperature), greedy=torch.zeros(S, dtype=torch.bool),
        all_greedy=False, top_k=None if top_k is None else torch.full((S,), top_k),
        top_p=None if top_p is None else torch.full((S,), top_p),
        min_p=None if min_p is None else torch.full((S,), min_p), bias=None, penalties=None,
        generators=[None] * S, max_num_logprobs=-1)


def _native_draw(logits, meta, u, greedy=None):
    S = logits.shape[0]
    out = torch.empty(S, dtype=torch.int64)
    greedy = torch.zeros(S, dtype=torch.bool) if greedy is None else greedy
    _native.sample_tokens(out, logits, greedy, meta.temperature, meta.top_k, meta.top_p,
                          meta.min_p, u)
    return out


def _assert_same_draws(logits, meta, u):
    """Native and reference tokens agree on every row whose target u * total is not within
    1e-6 of the total from a boundary of the reference CDF: the two exps differ by a few float32
    ulps (about 1e-7 relative), which moves a boundary by at most that fraction of the total,
    so such a row may take either neighbour."""
    weights, fallback = _weights(logits, meta)
    want = _draw(weights, u, fallback)
    got = _native_draw(logits, meta, u)
    assert (weights.gather(1, got[:, None]) > 0).all(), "a token of weight 0 was drawn"
    cdf = weights.double().cumsum(dim=-1)
    total = cdf[:, -1]
    target = u * total
    gap = (cdf - target[:, None]).abs().min(dim=-1).values / total
    clear = gap > 1e-6
    assert clear.float().mean() > 0.8  # the test has teeth: most rows are unambiguous
    mismatched = (got != want) & clear
    assert not mismatched.any(), (got[mismatched], want[mismatched])


@pytest.mark.parametrize("vocab", [49152, 1000, 37])  # 37 and 1000: the scalar tail and a part block
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_random_rows_draw_the_reference_token(vocab, temperature):
    g = torch.Generator().manual_seed(vocab)
    S = 64
    logits = torch.randn(S, vocab, generator=g) * 3
    u = torch.rand(S, generator=g, dtype=torch.float64)
    _assert_same_draws(logits, _meta(S, temperature), u)


@pytest.mark.parametrize("filters", [dict(min_p=0.05), dict(top_k=20), dict(top_p=0.8),
                                     dict(top_k=50, top_p=0.9, min_p=0.01)])
def test_filtered_rows_draw_the_reference_token(filters):
    g = torch.Generator().manual_seed(11)
    S = 128
    logits = torch.randn(S, 5000, generator=g) * 2
    u = torch.rand(S, generator=g, dtype=torch.float64)
    _assert_same_draws(logits, _meta(S, 0.9, **filters), u)


def test_banned_tokens_are_never_drawn():
    g = torch.Generator().manual_seed(3)
    S, V = 400, 300
    logits = torch.randn(S, V, generator=g)
    banned = torch.rand(S, V, generator=g) < 0.7
    banned[:, 5] = False  # every row keeps a token
    logits[banned] = float("-inf")
    for u in (torch.rand(S, generator=g, dtype=torch.float64),
              torch.full((S,), 1.0 - 2 ** -53, dtype=torch.float64), torch.zeros(S, dtype=torch.float64)):
        got = _native_draw(logits, _meta(S, 1.0), u)
        assert not banned.gather(1, got[:, None]).any()
    # u at the very top lands on each row's last token that can be drawn
    last = torch.tensor([max(i for i in range(V) if not banned[r, i]) for r in range(S)])
    top = _native_draw(logits, _meta(S, 1.0), torch.full((S,), 1.0 - 2 ** -53, dtype=torch.float64))
    assert torch.equal(top, last)


def test_greedy_rows_are_torch_argmax_ties_nan_and_inf_included():
    g = torch.Generator().manual_seed(5)
    S, V = 8, 49152
    logits = torch.randn(S, V, generator=g)
    logits[1, 100] = logits[1, 40000] = 50.0  # a tie: the first index
    logits[2, 7] = float("nan")  # NaN is the maximum, as for torch.argmax
    logits[2, 9000] = float("nan")
    logits[3] = float("-inf")  # nothing allowed: index 0
    logits[4, V - 1] = 99.0  # in the last vector
    greedy = torch.ones(S, dtype=torch.bool)
    out = torch.empty(S, dtype=torch.int64)
    _native.sample_tokens(out, logits, greedy)
    assert out.tolist() == logits.argmax(dim=-1).tolist()
    assert out[1] == 100 and out[2] == 7 and out[3] == 0 and out[4] == V - 1


def test_mixed_rows_and_the_draw_frequencies():
    """Greedy and random rows in one call; the random rows' frequencies follow softmax."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    S = 20000
    logits = probs.log().repeat(S, 1).contiguous()
    greedy = torch.zeros(S, dtype=torch.bool)
    greedy[::10] = True
    u = torch.rand(S, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    got = _native_draw(logits, _meta(S, 1.0), u, greedy)
    assert (got[greedy] == 0).all()
    freq = torch.bincount(got[~greedy], minlength=5).double() / (~greedy).sum()
    assert (freq - probs.double()).abs().max() < 0.015, freq
    assert freq[4] == 0


def test_bad_arguments_are_refused():
    logits = torch.randn(2, 10)
    out = torch.empty(2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="uniforms"):
        _native.sample_tokens(out, logits, torch.zeros(2, dtype=torch.bool), torch.ones(2))
    with pytest.raises(RuntimeError, match="positive temperature"):
        _native.sample_tokens(out, logits, torch.zeros(2, dtype=torch.bool), torch.zeros(2),
                              uniforms=torch.zeros(2, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="top_k"):
        _native.sample_tokens(out, logits, torch.zeros(2, dtype=torch.bool), torch.ones(2),
                              top_k=torch.ones(2), uniforms=torch.zeros(2, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="logits"):
        _native.sample_tokens(out, logits.double(), torch.ones(2, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="temperature"):
        _native.sample_tokens(out, logits, torch.zeros(2, dtype=torch.bool), torch.ones(3),
                              uniforms=torch.zeros(2, dtype=torch.float64))


@pytest.mark.parametrize("filters", [dict(top_k=20), dict(top_p=0.5), dict(top_k=60, top_p=0.7)])
def test_the_kept_set_is_the_sorted_rule_s(filters):
    """Over many uniforms one row's draws cover exactly the tokens the sort-based reference
    keeps (a nearly flat row, so that every kept token is drawn often)."""
    g = torch.Generator().manual_seed(2)
    trials, V = 30000, 300
    logits = (torch.randn(1, V, generator=g) * 0.2).expand(trials, V).contiguous()
    meta = _meta(trials, 1.0, **filters)
    weights, _ = _weights(logits[:1], _meta(1, 1.0, **filters))
    kept = set(torch.nonzero(weights[0] > 0).flatten().tolist())
    assert 10 < len(kept) < V
    got = _native_draw(logits, meta, torch.rand(trials, generator=g, dtype=torch.float64))
    assert set(got.tolist()) == kept


def test_ties_at_the_cut_keep_the_lower_indices():
    logits = torch.tensor([[1.0, 5.0, 5.0, 0.0, 5.0, 5.0]]).repeat(4000, 1)
    got = _native_draw(logits, _meta(4000, 1.0, top_k=3),
                       torch.rand(4000, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    assert set(got.tolist()) == {1, 2, 4}


def test_penalties_are_bitwise_the_dense_formula():
    """The native pass over token histories against the dense [S, V] form CUDA runs."""
    from pyserve.model.sampler import _apply_penalties, _apply_penalties_dense, build_metadata
    from pyserve.sampling_params import SamplingParams
    from pyserve.step import SamplingInputs

    g = torch.Generator().manual_seed(9)
    V = 1000
    rows = [dict(repetition_penalty=1.3), dict(frequency_penalty=0.7, presence_penalty=-0.4),
            dict(), dict(repetition_penalty=0.8, frequency_penalty=-1.1, presence_penalty=0.3)]
    inputs = []
    for params in rows:
        prompt = torch.randint(0, V, (300,), generator=g).tolist()
        output = torch.randint(0, V, (120,), generator=g).tolist() + [7, 7, 7]  # repeats count
        output.append(V + 3)  # beyond the model's vocabulary (a larger tokenizer's): skipped
        inputs.append(SamplingInputs(SamplingParams(temperature=1.0, **params), (2,), len(output),
                                     prompt, output))
    meta = build_metadata(inputs, [None] * len(rows), V, torch.device("cpu"))
    logits = torch.randn(len(rows), V, generator=g) * 4
    logits[0, :10] = 0.0
    raw = logits.clone()
    ours = _apply_penalties(logits, meta.penalties)
    assert torch.equal(logits, raw)  # the raw logits stay (logprobs read them)
    dense = _apply_penalties_dense(logits, meta.penalties)
    assert torch.equal(ours.view(torch.int32), dense.view(torch.int32))
    assert torch.equal(ours[2], raw[2])  # no penalties: untouched
    assert not torch.equal(ours[3], raw[3])


@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_logprob_columns_match_log_softmax(k):
    g = torch.Generator().manual_seed(k)
    R, V = 12, 49152
    logits = torch.randn(R, V, generator=g) * 4
    logits[3, 1000:2000] = float("-inf")  # banned tokens: logprob -inf, never in the top
    targets = torch.randint(0, V, (R,), generator=g)
    targets[0] = logits[0].argmax()
    picked, ranks, ids, values = _native.logprob_columns(logits, targets, k)
    reference = logits.log_softmax(dim=-1)
    want = reference.gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(picked, want, rtol=0, atol=2e-5)
    assert ranks[0] == 1
    assert torch.equal(ranks, (reference > want[:, None]).sum(dim=-1) + 1)
    if k:
        top = reference.topk(k, dim=-1)
        assert torch.equal(ids, top.indices)
        torch.testing.assert_close(values, top.values, rtol=0, atol=2e-5)
    else:
        assert ids.shape == (R, 0)


def test_logprob_columns_ties_take_the_lower_index_first():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 3.0, -1.0]])
    _, ranks, ids, _ = _native.logprob_columns(logits, torch.tensor([4]), 2)
    assert ids.tolist() == [[1, 3]] and ranks.tolist() == [1]
