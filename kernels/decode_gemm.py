"""The decode step's linears as one TMA-fed GEMM kernel: few rows, every weight byte streamed once.

Spec (`decode_gemm_ref`). x (M, K) bf16, w (N, K) (megatron's layout), ``splits`` S:
    S = 1, plain      x @ w.T rounded to bf16, (M, N)                         == F.linear(x, w)
    S > 1             fp32 partial sums over S equal K slices, (S, M, N)   == split_k_linear(x, w, S)
    swiglu            w = [gate | up] rows (2F, K): silu_mul(F.linear(x, w)), (M, F)
equal to the spec up to the GEMM's fp32 summation order.

Why a kernel of our own: at decode batch sizes these GEMMs are weight streams with a fixed cost of
a few µs each (launch, the first loads' latency, the last wave's tail: RESULTS.md). cuBLAS never
lets the next kernel start early (session 20); this kernel can (``pdl``: programmatic dependent
launch; it waits for its predecessor's writes at ``gdc_wait`` and lets its successor launch right
away), and can ask the L2 for its first weight tiles before that wait (``prefetch`` tiles), since
no kernel of the step writes weights. The weights are the MMA's M side (BLOCK_N of them) and the
rows its N side, so a 128-row batch is one MMA tile wide; the SwiGLU form accumulates the gate and
up rows of the same columns in one program and writes only their product.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megarl.kernels.dispatch import tl, triton
from megarl.kernels.paged_decode import f32_dot
from megarl.kernels.swiglu import silu_mul
from megarl.rollout.split_linear import split_k_linear


def decode_gemm_ref(x: torch.Tensor, w: torch.Tensor, splits: int = 1, swiglu: bool = False) -> torch.Tensor:
    if swiglu:
        return silu_mul(F.linear(x, w), backend="torch")
    return F.linear(x, w) if splits == 1 else split_k_linear(x, w, splits)


@triton.jit
def _prefetch_l2(ptrs):
    """Ask the L2 for the 128-byte lines at ptrs (nothing comes back to registers)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _swiglu_round(gate, up, dtype: tl.constexpr):
    """fp32 accumulators -> silu(gate) * up, rounded as F.linear's output, then as `silu_mul`."""
    g = gate.to(dtype).to(tl.float32)
    u = up.to(dtype).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    return (s * u).to(dtype)


@triton.jit
def _decode_gemm_kernel(x_desc, w_desc, w_ptr, out_ptr, M, n_out, k_split, stride_w, stride_part, stride_out,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SWIGLU: tl.constexpr, PARTIAL: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
                        STAGES: tl.constexpr, F32_DOT: tl.constexpr):
    """Program (n, s): output columns [n * BLOCK_N, + BLOCK_N) of every row (M <= BLOCK_M) over K slice s."""
    n0, split = tl.program_id(0) * BLOCK_N, tl.program_id(1)
    k_lo = split * k_split
    if PREFETCH > 0:  # the weights' first tiles into the L2, before waiting for x
        w_rows = w_ptr + (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)[:, None] * stride_w
        lines = k_lo + tl.arange(0, PREFETCH * BLOCK_K // 64)[None, :] * 64  # a 128-byte line = 64 bf16
        _prefetch_l2(w_rows + lines)
        if SWIGLU:
            _prefetch_l2(w_rows + n_out * stride_w + lines)
    if PDL:
        tl.extra.cuda.gdc_wait()  # x is the previous kernel's output
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in tl.range(k_lo, k_lo + k_split, BLOCK_K, num_stages=STAGES):
        x = x_desc.load([0, k0])  # (BM, BK); rows past M read as zero
        w = w_desc.load([n0, k0])  # (BN, BK)
        if F32_DOT:  # the CPU interpreter multiplies bf16's raw bits (`f32_dot`)
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(w, x.T, acc)
        if SWIGLU:
            up = w_desc.load([n_out + n0, k0])
            if F32_DOT:
                up = up.to(tl.float32)
            acc_up = tl.dot(up, x.T, acc_up)
    rows = tl.arange(0, BLOCK_M)[None, :]
    cols = n0 + tl.arange(0, BLOCK_N)[:, None]
    ok = (rows < M) & (cols < n_out)
    ptrs = out_ptr + split * stride_part + rows.to(tl.int64) * stride_out + cols  # (BN, BM): out transposed
    if SWIGLU:
        tl.store(ptrs, _swiglu_round(acc, acc_up, out_ptr.dtype.element_ty), mask=ok)
    elif PARTIAL:
        tl.store(ptrs, acc, mask=ok)
    else:
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def decode_gemm(x: torch.Tensor, w: torch.Tensor, splits: int = 1, swiglu: bool = False, block_n: int = 64,
                block_k: int = 64, stages: int = 4, num_warps: int = 4, pdl: bool = False,
                prefetch: int = 0) -> torch.Tensor:
    """See the module docstring; M <= 256 rows (one MMA tile of rows)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    (m, k), n = x.shape, w.shape[0]
    n_out = n // 2 if swiglu else n
    block_m = max(16, triton.next_power_of_2(m))
    if block_m > 256 or n_out % block_n or k % (splits * block_k) or (swiglu and splits > 1):
        raise ValueError(f"decode_gemm: M = {m}, N = {n_out}, K = {k}, S = {splits}, swiglu = {swiglu} outside "
                         f"the kernel (M <= 256, BLOCK_N {block_n} | N, S * BLOCK_K {block_k} | K, no split SwiGLU)")
    partial = splits > 1
    out = torch.empty((splits, m, n_out) if partial else (m, n_out), device=x.device,
                      dtype=torch.float32 if partial else x.dtype)
    _decode_gemm_kernel[(n_out // block_n, splits)](
        TensorDescriptor.from_tensor(x, [block_m, block_k]), TensorDescriptor.from_tensor(w, [block_n, block_k]),
        w, out, m, n_out, k // splits, w.stride(0), out.stride(0) if partial else 0, out.stride(-2),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SWIGLU=swiglu, PARTIAL=partial, PDL=pdl,
        PREFETCH=prefetch, STAGES=stages, F32_DOT=f32_dot(x.dtype), num_warps=num_warps, launch_pdl=pdl)
    return out
