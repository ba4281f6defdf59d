"""Split-K linears whose reduction runs in the next kernel (the decode step on CUDA).

At decode batch sizes a linear's M is small (32..512 rows), so cuBLAS gets few output tiles:
it leaves SMs idle or splits K itself, with one more launch for its reduction. Here the S partial products
come out of one strided batched GEMM as fp32, (S, T, N), and the kernel that reads the
linear's output anyway (the residual add + RMSNorm, `megarl_kernels.rms_norm`; for QKV the
decode attention, `megarl_kernels.paged_decode`) sums them in order and rounds once: what the
linear's own bf16 output would hold, one launch fewer.

Reference: ``F.linear(x, weight)`` == ``sum_parts_ref(split_k_linear(x, weight, S), dtype)``
up to fp32 summation order (tests/test_split_linear.py). On CPU the same split runs in fp32
(``bmm`` has no mixed-dtype output there); the decode step only takes it on CUDA.
"""
from __future__ import annotations

import torch


def split_k_linear(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """x (T, K) @ weight (N, K)^T as ``parts`` fp32 partial sums over K slices: (S, T, N)."""
    (t, k), n = x.shape, weight.shape[0]
    if k % parts or weight.shape[1] != k:
        raise ValueError(f"split_k_linear: K = {k} (weight {tuple(weight.shape)}) must split into {parts} equal slices")
    a = x.reshape(t, parts, k // parts).transpose(0, 1)  # (S, T, K/S), row stride K
    # a view, never a copy: a captured graph must read the very tensor the optimizer updates
    b = weight.view(n, parts, k // parts).permute(1, 2, 0)  # (S, K/S, N): each slice column-major, ld K
    if x.is_cuda:
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


# S by decode rows, per row-parallel linear (rows up to, S); more rows: no split. Chosen by timing
# each linear with the kernel that sums its partials (the add + RMSNorm; for QKV the GEMM alone) in a
# CUDA graph, weights rotating past the L2, against cuBLAS's F.linear, at the Qwen2.5-1.5B shapes
# (fc2 1536 x 8960, proj 1536 x 1536, qkv 2048 x 1536) and M = 32..512 (table in docs/performance.md):
# a split pays while M gives cuBLAS too few output tiles to fill the GPU, and stops paying once it
# has enough. Shapes not measured take the same S, rounded down to a divisor of K whose slices stay
# 16-byte aligned (`split_parts`). Any S gives F.linear's result up to fp32 summation order, so an
# unmeasured shape may be slower than its best split but is never wrong (tests/test_split_linear.py
# runs the choice on a second model shape). Every limit is a decode-graph bucket (graphs.BUCKETS),
# so an eager batch and its padded graph pick the same S.
SPLITS = {"fc2": ((64, 2), (256, 4), (512, 2)), "proj": ((128, 3), (256, 2)), "qkv": ((64, 4), (128, 3))}
ALIGN = 8  # K slice lengths a multiple of 8 elements: 16-byte aligned bf16 rows for cuBLAS


def split_parts(name: str, rows: int, k: int) -> int:
    """S for linear ``name`` at ``rows`` rows and input width k (1: no split)."""
    want = next((s for limit, s in SPLITS.get(name, ()) if rows <= limit), 1)
    return next(s for s in range(want, 0, -1) if k % s == 0 and (k // s) % ALIGN == 0 or s == 1)
