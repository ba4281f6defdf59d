"""Residual add + RMSNorm in one pass, with megatron's (local spec) rounding.

Spec (`add_rms_norm_ref`). x, residual (T, h) in the activation dtype; weight
(h,) in its own dtype (the model's params dtype; fp32 beside bf16 activations
works too):
    s = residual + x                          rounded to the activation dtype
    y = (s_f32 * rsqrt(mean(s_f32^2) + eps) * w_f32)   rounded to the activation dtype
returns (y, s): the normed input of the next sublayer and the new residual
stream. ``residual=None`` normalizes x alone (s = x). In fp32 these are exactly
the numbers of ``s = residual + x; F.rms_norm(s, (h,), w, eps)``; in bf16 they
round once where torch's composite rounds ``s * rsqrt(...)`` before the weight.

Kernel: one program per row, the row in registers (h <= 16384), one read of
x and residual, one write of y and s. The decode step calls it twice per layer
(before attention and before the MLP); unfused, the composite norm alone is
~6 launches.
"""
import torch
import torch.nn.functional as F

from megarl.kernels.dispatch import choose, next_pow2, tl, triton


def add_rms_norm_ref(x, residual, weight, eps: float):
    """The spec: (T, h), (T, h) | None, (h,) -> (y, s), both x.dtype."""
    s = x if residual is None else residual + x
    y = (s.float() * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return y, s


def add_rms_norm_torch(x, residual, weight, eps: float):
    s = x if residual is None else residual + x
    return F.rms_norm(s, (s.shape[-1],), weight, eps), s


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, h, eps, stride_x, stride_r, stride_y, stride_s,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < h
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
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


def add_rms_norm_triton(x, residual, weight, eps: float):
    t, h = x.shape
    y = torch.empty_like(x)
    s = torch.empty_like(x) if residual is not None else x
    if t:
        r = residual if residual is not None else x
        block = next_pow2(h)
        _add_rms_norm_kernel[(t,)](x, r, weight, y, s, h, eps, x.stride(0), r.stride(0), y.stride(0), s.stride(0),
                                   HAS_RESIDUAL=residual is not None, BLOCK=block,
                                   num_warps=max(1, min(16, block // 256)))
    return y, s


def add_rms_norm(x, residual, weight, eps: float, backend: str = "auto"):
    """(y, s) = (RMSNorm(residual + x), residual + x); see the module docstring."""
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("add_rms_norm: rows must be contiguous in the last dim")
    tensors = (x, weight) if residual is None else (x, residual, weight)
    impl = {"triton": add_rms_norm_triton, "torch": add_rms_norm_torch, "ref": add_rms_norm_ref}
    return impl[choose(backend, *tensors)](x, residual, weight, eps)
