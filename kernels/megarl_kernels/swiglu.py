"""SwiGLU of megatron's fused fc1 output: silu(gate) * up in one pass, and its backward.

Spec (`silu_mul_ref`). x (T, 2F) holds [gate | up] (megatron's fused
``linear_fc1`` with ``gated_linear_unit``); out (T, F) =
silu(gate) * up, silu rounded to the activation dtype before the product
(as ``F.silu(gate) * up`` computes it). Kernel: grid (T, F / BLOCK), one read
of x, one write of out (unfused: a chunk, a silu and a mul launch).

Training (`swiglu`, autograd). The backward of the spec, as torch's autograd
computes it through ``F.silu(gate) * up``, with s = silu(gate) rounded,
sig = sigmoid(gate) in fp32:
    d_up   = (dout * s)                                   rounded
    d_gate = ((dout * up) rounded) * sig * (1 + gate * (1 - sig))   rounded
written into one (T, 2F) gradient [d_gate | d_up]. Unfused, the forward and
backward take ~8 launches over (T, F) tensors (chunk's backward concatenates
the two halves); fused, the forward reads x once and the backward reads x and
dout once, the memory traffic the op needs.
"""
import torch
import torch.nn.functional as F

from megarl_kernels.dispatch import choose, tl, triton

BLOCK = 1024  # columns per program (8960 = 9 programs per row at the 1.5B shape); unswept


def silu_mul_ref(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def silu_mul_rounded(gate, up, dtype: tl.constexpr):
    """fp32 gate and up -> silu(gate) * up in dtype, with the spec's roundings: gate and up to dtype
    (a no-op for values loaded in dtype; F.linear's output rounding in `fc1_swiglu`), silu to dtype,
    the product to dtype."""
    g = gate.to(dtype).to(tl.float32)
    u = up.to(dtype).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    return (s * u).to(dtype)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, f, stride_x, stride_out, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < f
    g = tl.load(x_ptr + t * stride_x + cols, mask=ok, other=0.0)
    u = tl.load(x_ptr + t * stride_x + f + cols, mask=ok, other=0.0)
    tl.store(out_ptr + t * stride_out + cols, silu_mul_rounded(g.to(tl.float32), u.to(tl.float32), g.dtype), mask=ok)


@triton.jit
def _silu_mul_backward_kernel(x_ptr, dout_ptr, dx_ptr, f, stride_x, stride_d, stride_dx, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < f
    g = tl.load(x_ptr + t * stride_x + cols, mask=ok, other=0.0)
    u = tl.load(x_ptr + t * stride_x + f + cols, mask=ok, other=0.0).to(tl.float32)
    d = tl.load(dout_ptr + t * stride_d + cols, mask=ok, other=0.0).to(tl.float32)
    gf = g.to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-gf))
    s = (gf * sig).to(g.dtype).to(tl.float32)
    d_up = (d * s).to(g.dtype)
    d_silu = (d * u).to(g.dtype).to(tl.float32)
    d_gate = (d_silu * sig * (1.0 + gf * (1.0 - sig))).to(g.dtype)
    tl.store(dx_ptr + t * stride_dx + cols, d_gate, mask=ok)
    tl.store(dx_ptr + t * stride_dx + f + cols, d_up, mask=ok)


def silu_mul_triton(x):
    t, f = x.shape[0], x.shape[1] // 2
    out = torch.empty(t, f, dtype=x.dtype, device=x.device)
    if t:
        _silu_mul_kernel[(t, triton.cdiv(f, BLOCK))](x, out, f, x.stride(0), out.stride(0), BLOCK=BLOCK, num_warps=4)
    return out


def silu_mul_backward_triton(x, dout):
    """(T, 2F), (T, F) -> (T, 2F) gradient of x (module docstring)."""
    t, f = dout.shape
    dx = torch.empty_like(x)
    if t:
        _silu_mul_backward_kernel[(t, triton.cdiv(f, BLOCK))](x, dout, dx, f, x.stride(0), dout.stride(0),
                                                             dx.stride(0), BLOCK=BLOCK, num_warps=4)
    return dx


def silu_mul(x, backend: str = "auto"):
    """(T, 2F) [gate | up] -> (T, F) silu(gate) * up."""
    if x.stride(-1) != 1 or x.shape[-1] % 2:
        raise ValueError("silu_mul: x must be (T, 2F) with dense rows")
    return silu_mul_triton(x) if choose(backend, x) == "triton" else silu_mul_ref(x)


class _SwiGLU(torch.autograd.Function):
    """The Triton forward and backward; x is saved (not the (T, F) product), as torch's autograd does."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return silu_mul_triton(x)

    @staticmethod
    def backward(ctx, dout):
        (x,) = ctx.saved_tensors
        return silu_mul_backward_triton(x, dout.reshape(x.shape[0], -1).contiguous())


def swiglu(x, backend: str = "auto"):
    """Differentiable silu(gate) * up of x (..., 2F) -> (..., F); Triton forward and backward on CUDA,
    the torch spec (autograd through it) elsewhere."""
    if x.shape[-1] % 2:
        raise ValueError(f"swiglu: the last dim of x must be even (gate | up), got {tuple(x.shape)}")
    if choose(backend, x) != "triton":
        return silu_mul_ref(x)
    rows = x.reshape(-1, x.shape[-1])
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    return _SwiGLU.apply(rows).view(*x.shape[:-1], x.shape[-1] // 2)
