"""Masked reductions over token tensors: sum, mean, variance, whitening.

`mask` is float or bool, same shape as `x` (or broadcastable); non-zero marks
a real token. Masked-out positions are selected away (`torch.where`), never
multiplied by 0, so a NaN or inf there reaches neither a result nor a
gradient. Reductions over an empty mask give 0 instead of NaN.
"""
from __future__ import annotations

import torch
from torch import Tensor

WHITEN_EPS = 1e-8


def zero_masked(mask: Tensor, *xs: Tensor) -> tuple[Tensor, ...]:
    """Each x with its masked-out positions replaced by 0 (selected, so a NaN or
    inf there reaches neither the result nor, through later products, a gradient)."""
    real = mask != 0
    return tuple(torch.where(real, x, 0.0) for x in xs)


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of x where mask is set; over all elements when dim is None."""
    xm = torch.where(mask != 0, x, 0.0)
    return xm.sum() if dim is None else xm.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of x over masked elements; 0 where the mask is empty."""
    m = mask.to(x.dtype)
    count = m.sum() if dim is None else m.sum(dim)
    return masked_sum(x, m, dim) / count.clamp_min(1e-8)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of x over all masked elements (a scalar).

    unbiased: divide by n - 1 instead of n (Bessel); with n <= 1 the biased
    value (0) is returned rather than NaN.
    """
    m = mask.to(x.dtype)
    (x,) = zero_masked(m, x)  # a masked NaN would reach the gradient through (x - mean)^2
    mean = masked_mean(x, m)
    var = masked_mean((x - mean) ** 2, m)
    if unbiased:
        n = m.sum()
        var = torch.where(n > 1, var * n / (n - 1).clamp_min(1e-8), var)
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = WHITEN_EPS) -> Tensor:
    """(x - mean) / sqrt(var + eps) with mean and unbiased var over masked elements.

    shift_mean=False adds the mean back (scale only). Masked-out positions are
    set to 0 in the output.
    """
    m = mask.to(x.dtype)
    (x,) = zero_masked(m, x)
    mean = masked_mean(x, m)
    var = masked_var(x, m, unbiased=True)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(m != 0, out, 0.0)
