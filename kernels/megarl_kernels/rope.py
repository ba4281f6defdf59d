"""RoPE of packed training rows, forward and backward, one launch each.

Spec (`rope_ref`: megatron-core's ``_apply_rotary_pos_emb_bshd`` without
interleaving, partial rotary or mscale). t (T, H, D) in the activation dtype,
positions (T,) int, and the tables cos, sin (S, D) of megatron's angles in t's
dtype (`rope_tables`: ``torch.cos(freqs).to(dtype)``, as megatron rounds
them); with c = cos[pos], s = sin[pos] and rot(x) = [-x2, x1] (x1, x2 the two
halves of the last dim):
    out = (t * c) rounded + (rot(t) * s) rounded          rounded
Its backward, as torch's autograd computes it through those ops, with
rot^T(g) = [g2, -g1]:
    dt = (dout * c) rounded + rot^T((dout * s) rounded)   rounded
The tables come from torch, not from Triton's cos / sin (fast approximations
that drift at large angles: 17% of bf16 elements differed at angles up to 200
rad on the GPU). The kernels round where the spec rounds, but a bitwise check
against it failed on the GPU (the cause is not isolated, a contracted
multiply-add is suspected), so GPU results are taken as the spec's up to one
rounding (`tests/test_kernel_rope.py`'s tolerance cases).

Kernels: grid (T,), one program per token holding all H heads: one read of the
token's c and s rows for every head, one read of t (or dout) and one write.
Unfused, megatron takes ~10 launches per call (gather, cos, sin, two casts,
chunk, neg, cat, two muls, add) and as many again in the backward, for
queries and keys of every layer.
"""
import torch

from megarl_kernels.dispatch import choose, next_pow2, tl, triton


def _rotate_half(x):
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_tables(freqs, dtype):
    """(S, D) fp32 angles -> cos, sin (S, D) in ``dtype``, rounded as megatron rounds them."""
    return torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)


def rope_ref(t, positions, cos, sin):
    """The spec: (T, H, D), (T,), (S, D), (S, D) -> (T, H, D) in t.dtype (autograd through torch's ops)."""
    p = positions.long()
    return t * cos[p][:, None, :] + _rotate_half(t) * sin[p][:, None, :]


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, out_ptr, H, stride_xt, stride_xh, stride_ot, stride_oh, stride_c,
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
    c = tl.load(cos_ptr + pos * stride_c + d).to(tl.float32)  # (1, D)
    if BACKWARD:  # rot^T(g * s): element d takes +g[d + half] s[d + half] (d < half), -g[d - half] s[d - half]
        sp = tl.load(sin_ptr + pos * stride_c + partner).to(tl.float32)
        b = (xp * sp).to(x.dtype).to(tl.float32)
        b = tl.where(d < half, b, -b)
    else:  # rot(x) * s: element d takes -x[d + half] (d < half), +x[d - half]
        s = tl.load(sin_ptr + pos * stride_c + d).to(tl.float32)
        b = (tl.where(d < half, -xp, xp) * s).to(x.dtype).to(tl.float32)
    a = (x.to(tl.float32) * c).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + heads * stride_oh + d, (a + b).to(x.dtype), mask=ok)


def _launch(x, positions, cos, sin, backward: bool):
    T, H, D = x.shape
    out = torch.empty(T, H, D, dtype=x.dtype, device=x.device)
    if T:
        _rope_kernel[(T,)](x, positions, cos, sin, out, H, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
                           cos.stride(0), D=D, BLOCK_H=next_pow2(H), BACKWARD=backward,
                           num_warps=4 if H * D <= 2048 else 8)
    return out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, positions, cos, sin):
        ctx.save_for_backward(positions, cos, sin)
        return _launch(t, positions, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dout):
        positions, cos, sin = ctx.saved_tensors
        return _launch(dout.contiguous(), positions, cos, sin, backward=True), None, None, None


def rope(t, positions, cos, sin, backend: str = "auto"):
    """Differentiable RoPE (module docstring): t (T, H, D) with unit last stride, positions (T,) int,
    cos, sin (S, D) in t's dtype (`rope_tables`); D a power of two for the Triton path."""
    if (t.dim() != 3 or cos.dim() != 2 or cos.shape != sin.shape or cos.shape[-1] != t.shape[-1]
            or positions.shape != t.shape[:1]):
        raise ValueError(f"rope: want t (T, H, D), positions (T,), cos and sin (S, D); got {tuple(t.shape)}, "
                         f"{tuple(positions.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}")
    d = t.shape[-1]
    if choose(backend, t, positions, cos, sin) != "triton" or d & (d - 1) or d < 2:
        return rope_ref(t, positions, cos, sin)
    t = t if t.stride(-1) == 1 else t.contiguous()
    return _Rope.apply(t, positions.contiguous(), cos.to(t.dtype).contiguous(), sin.to(t.dtype).contiguous())
