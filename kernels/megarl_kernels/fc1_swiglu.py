"""fc1 and its SwiGLU in one kernel for decode-sized batches: silu(x W_gate^T) * (x W_up^T).

Spec (`fc1_silu_mul_ref`). x (M, K), w (2F, K) megatron's fused ``linear_fc1`` weight with
``gated_linear_unit`` (this rank's gate rows, then its up rows) -> (M, F) =
``silu_mul(F.linear(x, w))``: the GEMM's fp32 sums rounded to x.dtype as F.linear's output, then
`silu_mul`'s rounding. The kernel equals the spec up to the GEMM's fp32 summation order (on the GPU
bitwise, every element, at M = 32 to 128, `tests/test_kernel_fc1_swiglu.py`).

Kernel: program n owns BLOCK_N + TAIL output columns. It streams those columns' gate and up rows
of w through a TMA ring (host tensor descriptors) and accumulates both in fp32, then writes only
their SwiGLU, so the (M, 2F) fc1 output is never written or read back. The BLOCK_N tile has the
weights on the MMA's M side and the batch rows (M <= BLOCK_M) on its N side, so a decode batch is
one MMA tile wide; the TAIL tile (rows on the M side) lets a program's width be no power of two:
64 + 16 columns give 112 programs at F = 8,960 instead of 70 (128) or 140 (64, a second wave).
On Hopper it is launched as a programmatic dependent of the add + RMSNorm before it (which lets its
dependents start at once, `rms_norm.py`): its programs are placed and set up while the norm runs,
and wait at ``gdc_wait`` for the norm's writes. Before that wait they ask the L2 for the first K
step of their weight rows (`PREFETCH_STEPS`): the weights never depend on the norm, and HBM idles
while it runs (it reads its inputs from the L2), so the loop's first loads find them there.
Up to 128 rows it is faster than cuBLAS's fc1 then `silu_mul`; at 256 rows one row tile no longer
fits the registers and it runs at half their speed, so above `MAX_ROWS` (and for shapes the kernel
does not take, `fits_kernel`) the op is the two-kernel spec. Measurements: docs/performance.md.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megarl_kernels.dispatch import choose, hopper_or_newer, next_pow2, tl, triton
from megarl_kernels.paged_decode import f32_dot
from megarl_kernels.swiglu import silu_mul, silu_mul_rounded

# (BLOCK_N, TAIL, STAGES, NUM_WARPS) by the row tile (the next power of two >= M, at least 16), K
# steps of BLOCK_K. Chosen by timing norm + fc1 + SwiGLU in a CUDA graph over 44 tiles at the
# Qwen2.5-1.5B shape (K 1,536, F 8,960) and M = 32, 64, 96, 128 (table in docs/performance.md):
# one wide tile a program for few rows; for more rows 64 + 16 columns, so that F / 80 programs fill the GPU in one wave. Every tile is correct at any F and K that `fits_kernel`
# accepts (the tests run other shapes); at another F the program count is cdiv(F, BLOCK_N + TAIL),
# which may leave part of the GPU idle or take a second wave: slower, never wrong.
TILES = {16: (128, 0, 4, 8), 32: (128, 0, 4, 8), 64: (64, 16, 5, 4), 128: (64, 16, 5, 4)}
BLOCK_K = 64
MAX_ROWS = 128  # 256 rows run at half cuBLAS's speed
# K steps of each program's weight rows asked of the L2 before ``gdc_wait``, i.e. while the norm before
# fc1 still runs (HBM is idle then: the norm reads its inputs from the L2). One step was fastest at
# every M measured; deeper prefetches queue ahead of the loop's own loads (docs/performance.md).
PREFETCH_STEPS = 1


def fc1_silu_mul_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return silu_mul(F.linear(x, w), backend="torch")


@triton.jit
def _prefetch_l2(ptrs):
    """Ask the L2 for the 128-byte lines holding ptrs: a hint (`prefetch.global.L2`) that brings nothing
    back to registers and never faults. GPU only: the interpreter runs no inline assembly."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _prefetch_rows(w_ptr, n0, F, K, stride_w, WIDTH: tl.constexpr, ROWS: tl.constexpr, STEPS: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """The first STEPS K steps of the program's WIDTH gate rows and WIDTH up rows into the L2.
    ROWS >= WIDTH is a power of two; rows past WIDTH (or past F) repeat the last one."""
    r = tl.minimum(n0 + tl.minimum(tl.arange(0, ROWS), WIDTH - 1), F - 1).to(tl.int64)[:, None]  # (ROWS, 1)
    k = tl.minimum(tl.arange(0, STEPS) * BLOCK_K, K - 1)[None, :]  # (1, STEPS): a line's first element
    _prefetch_l2(w_ptr + r * stride_w + k)
    _prefetch_l2(w_ptr + (r + F) * stride_w + k)


@triton.jit
def _fc1_silu_mul_kernel(x_desc, w_desc, t_desc, w_ptr, out_ptr, M, F, K, stride_w, stride_out, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, TAIL: tl.constexpr, TAIL_BOX: tl.constexpr, BLOCK_K: tl.constexpr,
                         STAGES: tl.constexpr, F32_DOT: tl.constexpr, DEPENDENT: tl.constexpr,
                         PREFETCH: tl.constexpr, PREFETCH_ROWS: tl.constexpr):
    """Program n: output columns [n0, n0 + BLOCK_N + TAIL), n0 = n * (BLOCK_N + TAIL): a BLOCK_N tile
    with the weights on the MMA's M side, and a TAIL tile (0, 8 or 16 columns) with the rows on it.
    The tail tile is TAIL_BOX >= 16 columns wide (tl.dot's least); columns past TAIL are the next
    program's (read, not stored). Gate rows past F read up rows, up rows past 2F read zeros: both
    masked on store."""
    n0 = tl.program_id(0) * (BLOCK_N + TAIL)
    if PREFETCH > 0:  # weights do not depend on the norm: their first tiles move while it runs
        _prefetch_rows(w_ptr, n0, F, K, stride_w, BLOCK_N + TAIL, PREFETCH_ROWS, PREFETCH, BLOCK_K)
    if DEPENDENT:  # launched before the previous kernel (the norm that writes x) ends: wait for its writes
        tl.extra.cuda.gdc_wait()
    gate = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # the output tile, transposed
    up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    gate_t = tl.zeros([BLOCK_M, TAIL_BOX], tl.float32)
    up_t = tl.zeros([BLOCK_M, TAIL_BOX], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        x = x_desc.load([0, k0])  # (BM, BK); rows past M read as zero
        wg = w_desc.load([n0, k0])  # (BN, BK)
        wu = w_desc.load([F + n0, k0])
        if F32_DOT:  # the CPU interpreter multiplies bf16's raw bits (`f32_dot`)
            x, wg, wu = x.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        gate = tl.dot(wg, x.T, gate)
        up = tl.dot(wu, x.T, up)
        if TAIL > 0:
            tg = t_desc.load([n0 + BLOCK_N, k0])  # (TAIL_BOX, BK)
            tu = t_desc.load([F + n0 + BLOCK_N, k0])
            if F32_DOT:
                tg, tu = tg.to(tl.float32), tu.to(tl.float32)
            gate_t = tl.dot(x, tg.T, gate_t)
            up_t = tl.dot(x, tu.T, up_t)
    dtype = out_ptr.dtype.element_ty
    rows = tl.arange(0, BLOCK_M)[None, :]
    cols = n0 + tl.arange(0, BLOCK_N)[:, None]
    ptrs = out_ptr + rows.to(tl.int64) * stride_out + cols
    tl.store(ptrs, silu_mul_rounded(gate, up, dtype), mask=(rows < M) & (cols < F))
    if TAIL > 0:
        rows_t = tl.arange(0, BLOCK_M)[:, None]
        j = tl.arange(0, TAIL_BOX)[None, :]
        cols_t = n0 + BLOCK_N + j
        ptrs_t = out_ptr + rows_t.to(tl.int64) * stride_out + cols_t
        tl.store(ptrs_t, silu_mul_rounded(gate_t, up_t, dtype), mask=(rows_t < M) & (j < TAIL) & (cols_t < F))


def fits_kernel(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the kernel's tiles take these shapes (else the spec runs)."""
    (m, k), f = x.shape, w.shape[0] // 2
    dense = x.stride(-1) == 1 and w.stride(-1) == 1 and x.stride(0) % 8 == 0 and w.stride(0) % 8 == 0
    half = x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype  # fp32 would run as TF32
    if x.is_cuda and not hopper_or_newer(x):  # host tensor descriptors (TMA): sm_90+
        return False
    return 0 < m <= MAX_ROWS and f > 0 and k % BLOCK_K == 0 and dense and half  # 8: TMA's 16 B


def fc1_silu_mul_triton(x: torch.Tensor, w: torch.Tensor, tiles: tuple[int, int, int, int] | None = None,
                        prefetch: int | None = None):
    """The kernel at ``tiles`` = (BLOCK_N, TAIL, STAGES, NUM_WARPS) (default: `TILES` by row tile), asking
    the L2 for ``prefetch`` K steps of its weights before it waits for x (default `PREFETCH_STEPS` when
    launched as a dependent; 0 under the interpreter, which has no L2)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    (m, k), f = x.shape, w.shape[0] // 2
    block_m = max(16, next_pow2(m))
    block_n, tail, stages, num_warps = tiles or TILES[block_m]
    dependent = hopper_or_newer(x)  # programmatic dependent launch: the kernel's start overlaps the norm's
    steps = (PREFETCH_STEPS if dependent else 0) if prefetch is None else prefetch
    out = x.new_empty((m, f))
    w_desc = TensorDescriptor.from_tensor(w, [block_n, BLOCK_K])
    tail_box = max(16, tail)
    t_desc = TensorDescriptor.from_tensor(w, [tail_box, BLOCK_K]) if tail else w_desc
    _fc1_silu_mul_kernel[(triton.cdiv(f, block_n + tail),)](
        TensorDescriptor.from_tensor(x, [block_m, BLOCK_K]), w_desc, t_desc, w, out, m, f, k, w.stride(0),
        out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, TAIL=tail, TAIL_BOX=tail_box, BLOCK_K=BLOCK_K, STAGES=stages,
        F32_DOT=f32_dot(x.dtype), DEPENDENT=dependent, PREFETCH=steps, PREFETCH_ROWS=next_pow2(block_n + tail),
        num_warps=num_warps, launch_pdl=dependent)
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
