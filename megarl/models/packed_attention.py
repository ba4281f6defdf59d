"""Attention over packed (THD) sequences: a per-sequence SDPA reference and varlen.

q ``[t, np, hn]``, k/v ``[t, ng, hn]`` hold sequences back to back; sequence
i occupies rows ``cu_q[i]:cu_q[i+1]`` (keys ``cu_kv[i]:cu_kv[i+1]``) and attends
only to its own keys. :func:`packed_attention_ref` runs one SDPA per sequence
(the spec, and the CPU path); :func:`packed_attention_varlen` is flash
varlen attention (CUDA, fp16/bf16), called through its two aten ops (the ones
``torch.nn.attention.varlen.varlen_attn`` calls, without its custom-op glue).
:func:`packed_attention` picks varlen where it applies (CUDA sm80+, half
precision, no dropout, queries and keys with the same boundaries) and the
reference elsewhere.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

_HALF = (torch.float16, torch.bfloat16)


def packed_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                         cu_kv: torch.Tensor, causal: bool, scale: float, dropout: float = 0.0) -> torch.Tensor:
    """[t, np, hn] x [t, ng, hn] -> [t, np, hn], one causal (or full) SDPA per sequence."""
    out = q.new_zeros(q.shape)
    bounds = zip(cu_q.tolist()[:-1], cu_q.tolist()[1:], cu_kv.tolist()[:-1], cu_kv.tolist()[1:])
    for q0, q1, k0, k1 in bounds:
        if q1 == q0:
            continue
        # [len, n, hn] -> [1, n, len, hn]
        qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q[q0:q1], k[k0:k1], v[k0:k1]))
        out[q0:q1] = _sdpa(qs, ks, vs, causal, scale, dropout)[0].transpose(0, 1)
    return out


def _sdpa(q, k, v, causal: bool, scale: float, dropout: float):
    """q [1, np, sq, hn], k/v [1, ng, sk, hn]; causal queries are the last sq of sk positions."""
    sq, sk = q.shape[2], k.shape[2]
    mask, is_causal = None, False
    if causal and sq == sk:
        is_causal = sq > 1
    elif causal and sq > 1:
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal,
                                          scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def varlen_available(q: torch.Tensor, dropout: float = 0.0) -> bool:
    """Whether :func:`packed_attention_varlen` runs these queries (flash: sm80+, fp16/bf16, head dim <= 256)."""
    hn = q.shape[-1]
    return (q.is_cuda and q.dtype in _HALF and dropout == 0.0 and hn % 8 == 0 and hn <= 256
            and _flash_device(q.device.index))


@functools.lru_cache(maxsize=None)
def _flash_device(index: Optional[int]) -> bool:
    return (hasattr(torch.ops.aten, "_flash_attention_forward")
            and torch.cuda.get_device_capability(index)[0] >= 8)


class _FlashVarlen(torch.autograd.Function):
    """Flash varlen forward and backward as two aten calls.

    ``torch.nn.attention.varlen.varlen_attn`` wraps the same two ops in a
    ``torch.library`` custom op whose Python glue cost several times the host
    time of the two ops themselves, per layer and micro-batch, in a launch-bound
    actor update (torch 2.11; docs/performance.md), and it makes a zero
    rng-state tensor per call. Grouped K/V heads go in as they are
    (flash sums dk / dv over a group); dropout is 0, so rng_state is unused.
    """

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_kv, max_q: int, max_kv: int, causal: bool, scale: float):
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_kv, max_q, max_kv, 0.0, causal, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_kv, rng_state, unused)
        ctx.args = (max_q, max_kv, causal, scale)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_q, cu_kv, rng_state, unused = ctx.saved_tensors
        max_q, max_kv, causal, scale = ctx.args
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout.contiguous(), q, k, v, out, lse, cu_q, cu_kv, max_q, max_kv, 0.0, causal, rng_state, unused,
            scale=scale)
        return dq, dk, dv, None, None, None, None, None, None


def packed_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                            cu_kv: torch.Tensor, max_q: int, max_kv: int, causal: bool,
                            scale: float) -> torch.Tensor:
    """:func:`packed_attention_ref` as one flash varlen call (no dropout; :func:`varlen_available`)."""
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"packed attention: {q.shape[1]} query heads are not groups of {k.shape[1]} K/V heads")
    cu_q, cu_kv = cu_q.to(q.device, torch.int32), cu_kv.to(q.device, torch.int32)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return _FlashVarlen.apply(q, k, v, cu_q, cu_kv, int(max_q), int(max_kv), causal, float(scale))


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                     cu_kv: torch.Tensor, max_q: Optional[int], max_kv: Optional[int], causal: bool,
                     scale: float, dropout: float = 0.0) -> torch.Tensor:
    """Varlen where it applies, else the per-sequence reference."""
    same_bounds = cu_q is cu_kv or torch.equal(cu_q, cu_kv)
    if varlen_available(q, dropout) and same_bounds and max_q and max_kv:
        return packed_attention_varlen(q, k, v, cu_q, cu_kv, max_q, max_kv, causal, scale)
    return packed_attention_ref(q, k, v, cu_q, cu_kv, causal, scale, dropout)
