"""Residual add + RMSNorm in one pass, with megatron's (local spec) rounding.

Spec (`add_rms_norm_ref`). x, residual (T, h) in the activation dtype; weight
(h,) in its own dtype (the model's params dtype; fp32 beside bf16 activations
works too):
    s = residual + x                          rounded to the activation dtype
    y = (s_f32 * rsqrt(mean(s_f32^2) + eps) * w_f32)   rounded to the activation dtype
returns (y, s): the normed input of the next sublayer and the new residual
stream. ``residual=None`` normalizes x alone (s = x). x may also be the S
fp32 partial sums (S, T, h) of a split-K linear (`megarl.rollout.split_linear`):
they are summed in order 0..S-1 in fp32 and rounded to the residual's dtype
(what the linear's own output would hold) before the add. In fp32 these are exactly
the numbers of ``s = residual + x; F.rms_norm(s, (h,), w, eps)``; in bf16 they
round once where torch's composite rounds ``s * rsqrt(...)`` before the weight.

Kernel: one program per row, the row in registers (h <= 16384), one read of
x and residual, one write of y and s. The decode step calls it twice per layer
(before attention and before the MLP); unfused, the composite norm alone is
~6 launches.
"""
import torch
import torch.nn.functional as F

from megarl_kernels.dispatch import choose, hopper_or_newer, next_pow2, tl, triton


def sum_parts_ref(parts, dtype):
    """(S, T, h) fp32 partial sums -> (T, h) in dtype: added in order 0..S-1 in fp32, rounded once."""
    acc = parts[0].clone()
    for part in parts[1:]:
        acc += part
    return acc.to(dtype)


def add_rms_norm_ref(x, residual, weight, eps: float):
    """The spec: (T, h) or (S, T, h) parts, (T, h) | None, (h,) -> (y, s), both residual's (or x's) dtype."""
    if x.dim() == 3:
        x = sum_parts_ref(x, residual.dtype)
    s = x if residual is None else residual + x
    y = (s.float() * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return y, s


def add_rms_norm_torch(x, residual, weight, eps: float):
    if x.dim() == 3:
        x = sum_parts_ref(x, residual.dtype)
    s = x if residual is None else residual + x
    return F.rms_norm(s, (s.shape[-1],), weight, eps), s


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, h, eps, stride_x, stride_part, stride_r, stride_y,
                         stride_s, HAS_RESIDUAL: tl.constexpr, PARTS: tl.constexpr, BLOCK: tl.constexpr,
                         EARLY: tl.constexpr):
    row = tl.program_id(0)
    if EARLY:  # a successor launched as a dependent (`fc1_silu_mul`) may start now; it waits for our writes
        tl.extra.cuda.gdc_launch_dependents()
    cols = tl.arange(0, BLOCK)
    ok = cols < h
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if PARTS > 0:  # fp32 partial sums of a split-K linear: summed in order, rounded as its output
        for p in tl.static_range(1, PARTS):
            x += tl.load(x_ptr + p * stride_part + row * stride_x + cols, mask=ok, other=0.0)
        x = x.to(s_ptr.dtype.element_ty)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=ok, other=0.0)
        s = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)  # rounded as torch's add
        tl.store(s_ptr + row * stride_s + cols, s, mask=ok)
    else:
        s = x
    sf = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / h + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (sf * rstd * w).to(x.dtype), mask=ok)


# Warps per row program: one per 256 columns (8 at h = 1,536), one per 128 (16) for batches of up to
# FEW_ROWS rows, where there are too few row programs to hide a row's latency otherwise. Timed after
# the decode step's split-K linears at h = 1,536 and M = 32, 128, 512 (docs/performance.md); the rule
# is stated per column, so other hidden sizes scale with it (at most 16 warps). Any count is correct.
FEW_ROWS = 128


def norm_warps(rows: int, block: int, num_warps: int | None = None) -> int:
    return num_warps or max(1, min(16, block // (128 if rows <= FEW_ROWS else 256)))


def add_rms_norm_triton(x, residual, weight, eps: float, num_warps: int | None = None):
    parts = x.shape[0] if x.dim() == 3 else 0
    t, h = x.shape[-2:]
    like = x if residual is None else residual
    y = torch.empty_like(like)
    s = torch.empty_like(like) if residual is not None else x
    if t:
        r = residual if residual is not None else x
        block = next_pow2(h)
        _add_rms_norm_kernel[(t,)](x, r, weight, y, s, h, eps, x.stride(-2), x.stride(0) if parts else 0,
                                   r.stride(0), y.stride(0), s.stride(0), HAS_RESIDUAL=residual is not None,
                                   PARTS=parts, BLOCK=block, EARLY=hopper_or_newer(x),
                                   num_warps=norm_warps(t, block, num_warps))
    return y, s


def add_rms_norm(x, residual, weight, eps: float, backend: str = "auto"):
    """(y, s) = (RMSNorm(residual + x), residual + x); see the module docstring.

    x: (T, h), or (S, T, h) fp32 partial sums of one linear's output (then a residual is needed)."""
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("add_rms_norm: rows must be contiguous in the last dim")
    if x.dim() == 3 and (residual is None or x.dtype != torch.float32 or x.shape[1:] != residual.shape):
        raise ValueError(f"add_rms_norm: partial sums (S, T, h) must be fp32 beside a (T, h) residual; got x "
                         f"{tuple(x.shape)} {x.dtype}, residual {None if residual is None else tuple(residual.shape)}")
    tensors = (x, weight) if residual is None else (x, residual, weight)
    impl = {"triton": add_rms_norm_triton, "torch": add_rms_norm_torch, "ref": add_rms_norm_ref}
    return impl[choose(backend, *tensors)](x, residual, weight, eps)
