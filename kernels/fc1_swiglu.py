"""fc1 and its SwiGLU in one kernel for decode-sized batches: silu(x W_gate^T) * (x W_up^T).

Spec (`fc1_silu_mul_ref`). x (M, K), w (2F, K) megatron's fused ``linear_fc1`` weight with
``gated_linear_unit`` (this rank's gate rows, then its up rows) -> (M, F) =
``silu_mul(F.linear(x, w))``: the GEMM's fp32 sums rounded to x.dtype as F.linear's output, then
`silu_mul`'s rounding. The kernel equals the spec up to the GEMM's fp32 summation order (on the
H200 bitwise, every element, at M = 32 and 128: RESULTS.md session 23).

Kernel: program n owns output columns [n * BLOCK_N, (n + 1) * BLOCK_N). It streams those
columns' gate and up rows of w through a TMA ring (host tensor descriptors), with the weights as
the MMA's M side and the batch rows (M <= BLOCK_M) as its N side, so a decode batch is one MMA
tile wide; it accumulates gate and up in fp32 and writes only their SwiGLU, so the (M, 2F) fc1
output is never written or read back. Against cuBLAS's fc1 then `silu_mul` (H200, the 1.5B shape,
after the norm, weights past the L2, µs): M = 32 22.7 -> 20.6, 64 23.9 -> 21.8, 96 23.9 -> 25.0,
128 25.3 -> 25.3, 256 30.0 -> 59.6; so above `MAX_ROWS` (and for shapes the tiles do not divide)
the op is the two-kernel spec. In the decode loop: B = 32 1.84 -> 1.77 ms a step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megarl.kernels.dispatch import choose, next_pow2, tl, triton
from megarl.kernels.paged_decode import f32_dot
from megarl.kernels.swiglu import silu_mul

# Tiles from a sweep on the H200 (2026-12-04, the 1.5B shape, RESULTS.md session 23: 44 tiles at
# M = 128, the fastest 4 again at M = 32 and 256): 128 weight rows of gate and of up a program
# (70 programs at F = 8,960), 64-wide K steps, a 4-stage ring, 8 warps. Best at M = 32 and at 128.
BLOCK_N = 128
BLOCK_K = 64
STAGES = 4
NUM_WARPS = 8
MAX_ROWS = 64  # 96 rows (a 128-row tile) lose 1.1 µs, 128 tie, 256 run at half cuBLAS's speed


def fc1_silu_mul_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return silu_mul(F.linear(x, w), backend="torch")


@triton.jit
def _swiglu_round(gate, up, dtype: tl.constexpr):
    """fp32 sums -> silu(gate) * up, rounded as F.linear's output, then as `silu_mul`."""
    g = gate.to(dtype).to(tl.float32)
    u = up.to(dtype).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    return (s * u).to(dtype)


@triton.jit
def _fc1_silu_mul_kernel(x_desc, w_desc, out_ptr, M, F, K, stride_out, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                         F32_DOT: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    gate = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # the output tile, transposed
    up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        x = x_desc.load([0, k0])  # (BM, BK); rows past M read as zero
        wg = w_desc.load([n0, k0])  # (BN, BK)
        wu = w_desc.load([F + n0, k0])
        if F32_DOT:  # the CPU interpreter multiplies bf16's raw bits (`f32_dot`)
            x, wg, wu = x.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        gate = tl.dot(wg, x.T, gate)
        up = tl.dot(wu, x.T, up)
    rows = tl.arange(0, BLOCK_M)[None, :]
    cols = n0 + tl.arange(0, BLOCK_N)[:, None]
    ptrs = out_ptr + rows.to(tl.int64) * stride_out + cols
    tl.store(ptrs, _swiglu_round(gate, up, out_ptr.dtype.element_ty), mask=rows < M)


def fits_kernel(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the kernel's tiles take these shapes (else the spec runs)."""
    (m, k), f = x.shape, w.shape[0] // 2
    dense = x.stride(-1) == 1 and w.stride(-1) == 1 and x.stride(0) % 8 == 0 and w.stride(0) % 8 == 0
    half = x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype  # fp32 would run as TF32
    return 0 < m <= MAX_ROWS and f % BLOCK_N == 0 and k % BLOCK_K == 0 and dense and half  # 8: TMA's 16 B


def fc1_silu_mul_triton(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from triton.tools.tensor_descriptor import TensorDescriptor

    (m, k), f = x.shape, w.shape[0] // 2
    block_m = max(16, next_pow2(m))
    out = x.new_empty((m, f))
    _fc1_silu_mul_kernel[(f // BLOCK_N,)](
        TensorDescriptor.from_tensor(x, [block_m, BLOCK_K]), TensorDescriptor.from_tensor(w, [BLOCK_N, BLOCK_K]),
        out, m, f, k, out.stride(0), BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, STAGES=STAGES,
        F32_DOT=f32_dot(x.dtype), num_warps=NUM_WARPS)
    return out


def fc1_silu_mul(x: torch.Tensor, w: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """(M, K) x, (2F, K) [gate | up] weight -> (M, F) silu(x W_gate^T) * (x W_up^T); see the module
    docstring. The kernel where it is chosen and fits (`fits_kernel`), else F.linear then `silu_mul`."""
    if x.dim() != 2 or w.dim() != 2 or w.shape[1] != x.shape[1] or w.shape[0] % 2:
        raise ValueError(f"fc1_silu_mul: x (M, K) and w (2F, K) expected; got {tuple(x.shape)}, {tuple(w.shape)}")
    impl = choose(backend, x, w)
    if impl == "triton" and fits_kernel(x, w):
        return fc1_silu_mul_triton(x, w)
    if impl == "ref":
        return fc1_silu_mul_ref(x, w)
    return silu_mul(F.linear(x, w), backend="triton" if impl == "triton" else "torch")
