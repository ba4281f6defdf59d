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


# S by decode rows, per row-parallel linear (rows up to, S); more rows: no split. Measured on an
# H200 (2026-12-02, `bench_decode_options.py --parts splitk`, Qwen2.5-1.5B shapes, us per linear +
# its add-RMSNorm in a CUDA graph, weights rotating past the L2; cuBLAS F.linear -> best S):
#   fc2 (1536 x 8960):  M=32 14.5 -> 12.7 (S 2 or 5)   64 14.6 -> 12.8 (2)   128 15.4 -> 13.4 (4)
#                       256 21.7 -> 16.7 (4)           512 31.0 -> 24.6 (2)
#   proj (1536 x 1536): M=32 7.2 -> 6.6 (3)   64 7.3 -> 6.7 (3)   128 7.6 -> 7.0 (3)   256 8.0 -> 7.8 (2)
#                       512 9.5 -> 9.8 at S 2 (1 kept)
#   qkv (2048 x 1536, the GEMM alone; its bias and sum go to the attention kernel): M=32 5.7 -> 4.5 (4)
#                       64 5.8 -> 4.7 (4)   128 6.1 -> 5.0 (3)   256 6.1 -> 6.1 (1 kept)   512 8.0 -> 8.6 at 2
# Other shapes are unmeasured and take the same S (rounded down to a divisor of K). Every limit is a
# decode-graph bucket (graphs.BUCKETS), so an eager batch and its padded graph pick the same S.
SPLITS = {"fc2": ((64, 2), (256, 4), (512, 2)), "proj": ((128, 3), (256, 2)), "qkv": ((64, 4), (128, 3))}
ALIGN = 8  # K slice lengths a multiple of 8 elements: 16-byte aligned bf16 rows for cuBLAS


def split_parts(name: str, rows: int, k: int) -> int:
    """S for linear ``name`` at ``rows`` rows and input width k (1: no split)."""
    want = next((s for limit, s in SPLITS.get(name, ()) if rows <= limit), 1)
    return next(s for s in range(want, 0, -1) if k % s == 0 and (k // s) % ALIGN == 0 or s == 1)
