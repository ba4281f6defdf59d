"""RoPE of packed training rows, forward and backward, one launch each.

Spec (`rope_ref`: megatron-core's ``_apply_rotary_pos_emb_bshd`` without
interleaving, partial rotary or mscale). t (T, H, D) in the activation dtype,
positions (T,) int, freqs (S, D) fp32 angles (megatron's table: the D/2
frequencies twice); with c = cos(freqs[pos]), s = sin(freqs[pos]) rounded to
t's dtype and rot(x) = [-x2, x1] (x1, x2 the two halves of the last dim):
    out = (t * c) rounded + (rot(t) * s) rounded          rounded
Its backward, as torch's autograd computes it through those ops, with
rot^T(g) = [g2, -g1]:
    dt = (dout * c) rounded + rot^T((dout * s) rounded)   rounded

Kernels: grid (T,), one program per token holding all H heads: the token's
angles are read and their cos / sin taken once for every head; one read of t
(or dout) and one write. Unfused, megatron takes ~10 launches per call
(gather, cos, sin, two casts, chunk, neg, cat, two muls, add) and as many
again in the backward, for queries and keys of every layer. Triton's cos / sin
are not torch's to the last fp32 bit, so c and s (rounded to bf16) can differ
in rare elements: GPU results equal the spec up to that rounding.
"""
import torch

from megarl.kernels.dispatch import choose, next_pow2, tl, triton


def _rotate_half(x):
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_ref(t, positions, freqs):
    """The spec: (T, H, D), (T,), (S, D) fp32 -> (T, H, D) in t.dtype (autograd through torch's ops)."""
    f = freqs[positions.long()][:, None, :]  # (T, 1, D)
    cos, sin = torch.cos(f).to(t.dtype), torch.sin(f).to(t.dtype)
    return t * cos + _rotate_half(t) * sin


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, freqs_ptr, out_ptr, H, stride_xt, stride_xh, stride_ot, stride_oh, stride_f,
                 D: tl.constexpr, BLOCK_H: tl.constexpr, BACKWARD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]  # (BH, 1)
    d = tl.arange(0, D)[None, :]  # (1, D)
    half = D // 2
    partner = tl.where(d < half, d + half, d - half)
    ok = heads < H
    x_row = x_ptr + t * stride_xt + heads * stride_xh
    x = tl.load(x_row + d, mask=ok, other=0.0)
    xp = tl.load(x_row + partner, mask=ok, other=0.0).to(tl.float32)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    angle = tl.load(freqs_ptr + pos * stride_f + d)  # (1, D) fp32
    c = tl.cos(angle).to(x.dtype).to(tl.float32)
    if BACKWARD:  # rot^T(g * s): element d takes +g[d + half] s[d + half] (d < half), -g[d - half] s[d - half]
        sp = tl.sin(tl.load(freqs_ptr + pos * stride_f + partner)).to(x.dtype).to(tl.float32)
        b = (xp * sp).to(x.dtype).to(tl.float32)
        b = tl.where(d < half, b, -b)
    else:  # rot(x) * s: element d takes -x[d + half] (d < half), +x[d - half]
        s = tl.sin(angle).to(x.dtype).to(tl.float32)
        b = (tl.where(d < half, -xp, xp) * s).to(x.dtype).to(tl.float32)
    a = (x.to(tl.float32) * c).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + heads * stride_oh + d, (a + b).to(x.dtype), mask=ok)


def _launch(x, positions, freqs, backward: bool):
    T, H, D = x.shape
    out = torch.empty(T, H, D, dtype=x.dtype, device=x.device)
    if T:
        _rope_kernel[(T,)](x, positions, freqs, out, H, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
                           freqs.stride(0), D=D, BLOCK_H=next_pow2(H), BACKWARD=backward,
                           num_warps=4 if H * D <= 2048 else 8)
    return out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, positions, freqs):
        ctx.save_for_backward(positions, freqs)
        return _launch(t, positions, freqs, backward=False)

    @staticmethod
    def backward(ctx, dout):
        positions, freqs = ctx.saved_tensors
        return _launch(dout.contiguous(), positions, freqs, backward=True), None, None


def rope(t, positions, freqs, backend: str = "auto"):
    """Differentiable RoPE (module docstring): t (T, H, D) with unit last stride, positions (T,) int,
    freqs (S, D) fp32 with D even and a power of two for the Triton path."""
    if t.dim() != 3 or freqs.dim() != 2 or freqs.shape[-1] != t.shape[-1] or positions.shape != t.shape[:1]:
        raise ValueError(f"rope: want t (T, H, D), positions (T,), freqs (S, D); got {tuple(t.shape)}, "
                         f"{tuple(positions.shape)}, {tuple(freqs.shape)}")
    d = t.shape[-1]
    if choose(backend, t, positions, freqs) != "triton" or d & (d - 1) or d < 2:
        return rope_ref(t, positions, freqs)
    t = t if t.stride(-1) == 1 else t.contiguous()
    return _Rope.apply(t, positions.contiguous(), freqs.float().contiguous())
