"""Hugging Face <-> Megatron tensor layouts, in plain torch.

Megatron's fused QKV weight (``linear_qkv.weight``) orders rows by key/value
group: for each group ``g`` the ``h = heads / groups`` query heads' rows
(``h * d``), then the group's key rows (``d``), then its value rows (``d``).
A TP rank holds ``groups / tp`` consecutive groups, so the full tensor is the
concatenation of the TP shards. The fused MLP input (``linear_fc1.weight``)
is, on each TP rank ``r``, ``cat([gate rows of shard r, up rows of shard r])``.
Vocab-parallel tensors (embedding, LM head) hold ``padded_vocab / tp``
consecutive rows per rank; rows past the real vocab are zero.

The same functions work on biases (1-D) as on weights (2-D): every
reshuffle is along dim 0.
"""
from __future__ import annotations

import torch

from megarl_kernels import fc1_split, qkv_merge, qkv_split


def chunk_range(total: int, rank: int, size: int) -> tuple[int, int]:
    """Rows ``[start, end)`` of shard ``rank`` when ``total`` splits evenly ``size`` ways."""
    if total % size:
        raise ValueError(f"{total} rows do not split evenly over {size} ranks")
    step = total // size
    return rank * step, (rank + 1) * step


def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """q ``[G*h*d, ...]``, k, v ``[G*d, ...]`` -> Megatron's fused ``[G*(h+2)*d, ...]``
    (one pass: ``megarl_kernels.qkv_merge``; ``qkv_merge_ref`` is its torch.cat reference)."""
    return qkv_merge(q, k, v, groups)


def split_qkv(qkv: torch.Tensor, groups: int, heads: int) -> tuple[torch.Tensor, ...]:
    """Inverse of :func:`interleave_qkv`: fused ``[G*(h+2)*d, ...]`` -> q, k, v."""
    return qkv_split(qkv, heads, groups)


def qkv_ranges(groups: int, heads: int, head_dim: int, rank: int, size: int) -> tuple:
    """Row ranges of q_proj, k_proj, v_proj that TP rank ``rank`` fuses into its shard."""
    g0, g1 = chunk_range(groups, rank, size)
    qd = heads // groups * head_dim
    kv = (g0 * head_dim, g1 * head_dim)
    return (g0 * qd, g1 * qd), kv, kv


def split_gate_up(shards: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """TP shards of ``linear_fc1`` ``[2*F/tp, h]`` each -> full gate ``[F, h]``, up ``[F, h]``."""
    return fc1_split(torch.cat(shards), tp_size=len(shards))


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t [n, ...]`` -> ``[rows, ...]`` with zero rows appended (n <= rows)."""
    if t.shape[0] == rows:
        return t
    pad = t.new_zeros(rows - t.shape[0], *t.shape[1:])
    return torch.cat([t, pad])


# Mixture-of-experts: megatron-core's GroupedMLP keeps all E local experts in two tensors that
# its grouped GEMM views per expert: ``weight1.view(E, h, 2F/etp)[e]`` is expert e's fc1
# (``x @ it``: gate then up columns), ``weight2.view(E, F/etp, h)[e]`` its fc2. In the
# per-expert (SequentialMLP) terms: ``fc1_e`` [2F/etp, h] and ``fc2_e`` [h, F/etp] transposed.
def group_fc1(fc1: list[torch.Tensor]) -> torch.Tensor:
    """Per-expert ``fc1_e`` [2F/etp, h] -> GroupedMLP ``weight1`` [h, E*2F/etp] (same bytes as [E, h, 2F/etp])."""
    stacked = torch.stack([w.t() for w in fc1])  # (E, h, 2F/etp)
    return stacked.reshape(stacked.shape[1], -1)


def ungroup_fc1(weight1: torch.Tensor, num_experts: int) -> list[torch.Tensor]:
    """Inverse of :func:`group_fc1`."""
    return [w.t() for w in weight1.reshape(num_experts, weight1.shape[0], -1)]


def group_fc2(fc2: list[torch.Tensor]) -> torch.Tensor:
    """Per-expert ``fc2_e`` [h, F/etp] -> GroupedMLP ``weight2`` [E*F/etp, h]."""
    return torch.cat([w.t() for w in fc2])


def ungroup_fc2(weight2: torch.Tensor, num_experts: int) -> list[torch.Tensor]:
    """Inverse of :func:`group_fc2`."""
    return [w.t() for w in weight2.reshape(num_experts, -1, weight2.shape[1])]
