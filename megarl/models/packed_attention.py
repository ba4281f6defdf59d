"""Attention over packed (THD) sequences: a per-sequence SDPA reference and varlen.

q ``[t, np, hn]``, k/v ``[t, ng, hn]`` hold sequences back to back; sequence
i occupies rows ``cu_q[i]:cu_q[i+1]`` (keys ``cu_kv[i]:cu_kv[i+1]``) and attends
only to its own keys. :func:`packed_attention_ref` runs one SDPA per sequence
(the spec, and the CPU path); :func:`packed_attention_varlen` is one call of
``torch.nn.attention.varlen.varlen_attn`` (flash varlen, CUDA, fp16/bf16).
:func:`packed_attention` picks varlen where it applies (CUDA, half precision,
no dropout, queries and keys with the same boundaries) and the reference
elsewhere. The varlen signature changed across torch releases (2.9:
``is_causal``; later: keyword ``window_size``, ``scale``, ``enable_gqa``; grouped K/V
heads go in as they are on every one of them);
:func:`packed_attention_varlen` adapts to the installed one.
"""
from __future__ import annotations

import functools
import inspect
import math
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


@functools.lru_cache(maxsize=1)
def _varlen():
    """(varlen_attn, its parameter names), or None when this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def varlen_available(q: torch.Tensor, dropout: float = 0.0) -> bool:
    """Whether :func:`packed_attention_varlen` runs these queries (flash varlen: CUDA, fp16/bf16)."""
    return _varlen() is not None and q.is_cuda and q.dtype in _HALF and dropout == 0.0


def packed_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                            cu_kv: torch.Tensor, max_q: int, max_kv: int, causal: bool,
                            scale: float) -> torch.Tensor:
    """:func:`packed_attention_ref` as one ``varlen_attn`` call (no dropout)."""
    fn, params = _varlen()
    kwargs = {}
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = k.shape[1] != q.shape[1]
    # Older torch (2.9-2.11) has no enable_gqa but hands k / v unchanged to flash varlen, which
    # takes grouped heads (and sums dk / dv over a group): no copy of the K/V groups either way.
    if "scale" in params:
        kwargs["scale"] = scale
    elif not math.isclose(scale, 1.0 / math.sqrt(q.shape[-1])):
        raise ValueError("this torch's varlen_attn has no scale argument; use the per-sequence SDPA path")
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    else:
        kwargs["is_causal"] = causal
    cu_q, cu_kv = cu_q.to(q.device, torch.int32), cu_kv.to(q.device, torch.int32)
    return fn(q, k, v, cu_q, cu_kv, max_q, max_kv, **kwargs)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                     cu_kv: torch.Tensor, max_q: Optional[int], max_kv: Optional[int], causal: bool,
                     scale: float, dropout: float = 0.0) -> torch.Tensor:
    """Varlen where it applies, else the per-sequence reference."""
    same_bounds = cu_q is cu_kv or torch.equal(cu_q, cu_kv)
    if varlen_available(q, dropout) and same_bounds and max_q and max_kv:
        return packed_attention_varlen(q, k, v, cu_q, cu_kv, max_q, max_kv, causal, scale)
    return packed_attention_ref(q, k, v, cu_q, cu_kv, causal, scale, dropout)
