"""The CPU small-batch linear kernel against torch's F.linear on the same (widened) weights."""

import pytest
import torch
import torch.nn.functional as F

from pyserve import _native


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 16])
@pytest.mark.parametrize("n,k", [(960, 576), (577, 1536), (3, 13)])  # odd N and K take the tails
def test_linear_matches_torch(weight_dtype, m, n, k):
    gen = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=gen)
    weight = torch.randn(n, k, generator=gen).to(weight_dtype)
    bias = torch.randn(n, generator=gen)
    out = torch.empty(m, n)
    _native.linear(out, x, weight, bias)
    expected = F.linear(x.double(), weight.double(), bias.double()).float()
    torch.testing.assert_close(out, expected, atol=1e-4 * k ** 0.5, rtol=1e-4)
    _native.linear(out, x, weight)  # no bias
    torch.testing.assert_close(out, F.linear(x.double(), weight.double()).float(),
                               atol=1e-4 * k ** 0.5, rtol=1e-4)


def test_linear_refuses_what_it_cannot_do():
    out = torch.empty(2, 4)
    with pytest.raises(RuntimeError, match="float32"):
        _native.linear(out, torch.randn(2, 8).double(), torch.randn(4, 8))
    with pytest.raises(RuntimeError, match="\\[M, K\\]"):
        _native.linear(out, torch.randn(2, 8), torch.randn(4, 9))
    with pytest.raises(RuntimeError, match="contiguous"):
        _native.linear(out, torch.randn(8, 2).t(), torch.randn(4, 8))
