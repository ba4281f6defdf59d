"""megarl.algos.masked: masked sum/mean/var/whiten on a 2x3 example.

The masked values are 1, 2, 3, 4 (row 0 full, row 1 only its first token):
sum 10, mean 2.5, squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5, so the
biased variance is 5/4 and the unbiased 5/3.
"""
import math

import torch

from megarl.algos.masked import masked_mean, masked_sum, masked_var, masked_whiten

X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]], dtype=torch.float64)
M = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)


def test_sum_mean_var():
    """Values from the module docstring; row means are 2 and 4."""
    assert masked_sum(X, M).item() == 10.0
    assert masked_mean(X, M).item() == 2.5
    assert masked_mean(X, M, dim=-1).tolist() == [2.0, 4.0]
    assert math.isclose(masked_var(X, M, unbiased=False).item(), 5 / 4)
    assert math.isclose(masked_var(X, M).item(), 5 / 3)


def test_empty_mask_gives_zero():
    """An empty mask has no elements: mean and var are defined as 0, not NaN."""
    empty = torch.zeros_like(M)
    assert masked_mean(X, empty).item() == 0.0
    assert masked_var(X, empty).item() == 0.0


def test_whiten():
    """(x - 2.5) / sqrt(5/3 + 1e-8) at real tokens, 0 at masked ones; shift_mean=False adds 2.5 back."""
    std = math.sqrt(5 / 3 + 1e-8)
    expected = torch.tensor([[-1.5, -0.5, 0.5], [1.5, 0.0, 0.0]], dtype=torch.float64) / std
    torch.testing.assert_close(masked_whiten(X, M), expected)
    torch.testing.assert_close(masked_whiten(X, M, shift_mean=False), (expected + 2.5) * M)


def test_masked_nan_and_inf_are_ignored():
    """X's masked positions set to NaN and inf: every reduction and whiten give the
    values above, and the gradients (of var, the worst case: (x - mean)^2) are
    finite and equal those with 0 there -- x * mask would have made all NaN."""
    clean = torch.where(M, X, 0.0)
    bad = torch.where(M, X, torch.tensor([[0.0, 0.0, 0.0], [0.0, math.nan, math.inf]], dtype=X.dtype))
    assert masked_sum(bad, M).item() == 10.0 and masked_mean(bad, M, dim=-1).tolist() == [2.0, 4.0]
    torch.testing.assert_close(masked_whiten(bad, M), masked_whiten(clean, M), rtol=0, atol=0)
    grads = []
    for x in (clean, bad):
        x = x.clone().requires_grad_(True)
        masked_var(x, M).backward()
        grads.append(x.grad)
    assert torch.isfinite(grads[1]).all() and torch.equal(grads[0], grads[1])
