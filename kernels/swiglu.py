"""SwiGLU of megatron's fused fc1 output: silu(gate) * up in one pass.

Spec (`silu_mul_ref`). x (T, 2F) holds [gate | up] (megatron's fused
``linear_fc1`` with ``gated_linear_unit``); out (T, F) =
silu(gate) * up, silu rounded to the activation dtype before the product
(as ``F.silu(gate) * up`` computes it). Kernel: grid (T, F / BLOCK), one read
of x, one write of out (unfused: a chunk, a silu and a mul launch).
"""
import torch
import torch.nn.functional as F

from megarl.kernels.dispatch import choose, tl, triton

BLOCK = 1024  # columns per program (8960 = 9 programs per row at the 1.5B shape); unswept


def silu_mul_ref(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, f, stride_x, stride_out, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < f
    g = tl.load(x_ptr + t * stride_x + cols, mask=ok, other=0.0)
    u = tl.load(x_ptr + t * stride_x + f + cols, mask=ok, other=0.0).to(tl.float32)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(out_ptr + t * stride_out + cols, (s * u).to(g.dtype), mask=ok)


def silu_mul_triton(x):
    t, f = x.shape[0], x.shape[1] // 2
    out = torch.empty(t, f, dtype=x.dtype, device=x.device)
    if t:
        _silu_mul_kernel[(t, triton.cdiv(f, BLOCK))](x, out, f, x.stride(0), out.stride(0), BLOCK=BLOCK, num_warps=4)
    return out


def silu_mul(x, backend: str = "auto"):
    """(T, 2F) [gate | up] -> (T, F) silu(gate) * up."""
    if x.stride(-1) != 1 or x.shape[-1] % 2:
        raise ValueError("silu_mul: x must be (T, 2F) with dense rows")
    return silu_mul_triton(x) if choose(backend, x) == "triton" else silu_mul_ref(x)
