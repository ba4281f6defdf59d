"""The linear layers of a decode step: few rows, every weight byte streamed once.

Spec (`decode_linear_ref`, `decode_swiglu_ref`). x (M, K), w (N, K) row-major
(megatron's layout), bias (N,) or None:
    decode_linear(x, w, b) = x @ w.T + b                      (M, N) in x.dtype
    decode_swiglu(x, w)    = silu_mul(x @ w.T)  with w = [gate | up] rows (2F, K) -> (M, F)
fp32 accumulation, rounded to x.dtype once per GEMM output, as ``F.linear``; the
SwiGLU keeps `silu_mul`'s rounding (gate and up rounded, silu rounded, product
rounded), so fused == ``silu_mul(F.linear(x, w))`` up to the GEMM's summation order.

Why a kernel at all: at decode batch sizes (M <= 256) these GEMMs read the
weights once and do little arithmetic, so they should run at HBM speed; cuBLAS
picks tiles for compute and launches few CTAs for narrow outputs (QKV and the
output projection of the 1.5B shape ran at ~1 TB/s). Here the grid is
(M tiles x N tiles, S) where S splits K so that every SM streams weights:
split s accumulates K tiles [s * Ks, (s + 1) * Ks) and, with S > 1, writes fp32
partials (S, M, N) that `_reduce_kernel` sums in split order (deterministic:
no atomics, the same bits every replay), then adds bias / applies SwiGLU and
rounds. The SwiGLU kernel accumulates the gate and up tiles of the same
columns in one program, so the (M, 2F) fc1 output is never written.

Tile choice (`gemm_config`): from `benchmarks/bench_gemm.py` on an H200, see
the constants below. Shapes outside `MAX_ROWS`, and CPU tensors under
backend="auto", go to ``F.linear`` (and `silu_mul`), the tested reference.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megarl.kernels.dispatch import choose, next_pow2, pdl_usable, tl, triton
from megarl.kernels.paged_decode import f32_dot
from megarl.kernels.swiglu import silu_mul

# Rows above this go to cuBLAS (compute-bound there). Unswept placeholder until bench_gemm.
MAX_ROWS = 256
# Programs to aim for per SM when choosing the split count; unswept placeholder.
PROGRAMS_PER_SM = 2
BLOCK_N = 64
BLOCK_K = 128
NUM_WARPS = 4
NUM_STAGES = 4
CPU_SM_COUNT = 4  # interpreter runs: a stand-in SM count
REDUCE_BLOCK = 1024


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    splits: int
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return CPU_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count


def gemm_config(m: int, n: int, k: int, device: torch.device, block_n: int = BLOCK_N, block_k: int = BLOCK_K,
                programs_per_sm: int = PROGRAMS_PER_SM, num_warps: int = NUM_WARPS,
                num_stages: int = NUM_STAGES, block_m: int | None = None) -> GemmConfig:
    """Tiles and split count from shapes alone (so a CUDA graph and eager pick the same)."""
    bm = block_m or min(128, max(16, next_pow2(m)))
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k, block_k)
    want = triton.cdiv(programs_per_sm * _sm_count(device), tiles)
    splits = max(1, min(want, k_tiles // 2 or 1))  # at least 2 K tiles per split
    return GemmConfig(bm, block_n, block_k, splits, num_warps, num_stages)


# ---- reference ----

def decode_linear_ref(x, w, bias=None):
    return F.linear(x, w, bias)


def decode_swiglu_ref(x, w):
    return silu_mul(F.linear(x, w), backend="torch")


# ---- Triton ----

@triton.jit
def _silu_mul_round(gate, up, dtype: tl.constexpr):
    """fp32 accumulators -> silu(gate) * up with `silu_mul`'s rounding (after F.linear's)."""
    g = gate.to(dtype).to(tl.float32)
    u = up.to(dtype).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    return (s * u).to(dtype)


@triton.jit
def _prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines at ptrs (nothing is returned to registers)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _prefetch_weights(w_rows, k_lo, k_hi, BLOCK_N: tl.constexpr, LINES: tl.constexpr, ELEMS_PER_LINE: tl.constexpr):
    """Prefetch rows w_rows (BN, 1) over columns [k_lo, k_hi) to L2, one request per line."""
    lines = tl.arange(0, LINES)
    for k0 in range(k_lo, k_hi, LINES * ELEMS_PER_LINE):
        k = k0 + lines * ELEMS_PER_LINE
        _prefetch_l2(w_rows + tl.minimum(k, k_hi - 1)[None, :])


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, M, N, K, n_out, sx, sw, so, k_tiles_per_split,
                 HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, DIRECT: tl.constexpr, EVEN_K: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr,
                 PDL: tl.constexpr, PREFETCH: tl.constexpr, ELEMS_PER_LINE: tl.constexpr):
    """Program (tile, split): rows tile // n_tiles, columns tile % n_tiles, its K tiles.

    n_out: output columns (N, or F = N / 2 with SWIGLU, whose up rows start at F). PDL: the
    weights (which no kernel of the step writes) are prefetched to L2 before waiting for
    the predecessor's writes (x); PREFETCH without PDL prefetches all the same.
    """
    tile, split = tl.program_id(0), tl.program_id(1)
    n_tiles = tl.cdiv(n_out, BLOCK_N)
    rows = (tile // n_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (tile % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < n_out
    kk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * sx  # (BM, 1)
    w_rows = w_ptr + tl.minimum(cols, n_out - 1).to(tl.int64)[:, None] * sw  # (BN, 1)
    k_lo = split * k_tiles_per_split * BLOCK_K
    k_hi = tl.minimum(k_lo + k_tiles_per_split * BLOCK_K, K)
    if PREFETCH:
        _prefetch_weights(w_rows, k_lo, k_hi, BLOCK_N, 8, ELEMS_PER_LINE)
        if SWIGLU:
            _prefetch_weights(w_rows + n_out * sw, k_lo, k_hi, BLOCK_N, 8, ELEMS_PER_LINE)
    if PDL:
        tl.extra.cuda.gdc_wait()  # x (and the buffers written below) are the predecessor's
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + kk
        if EVEN_K:
            x_ok, w_ok = row_ok[:, None], col_ok[:, None]
        else:
            x_ok, w_ok = row_ok[:, None] & (k < K)[None, :], col_ok[:, None] & (k < K)[None, :]
        a = tl.load(x_rows + k[None, :], mask=x_ok, other=0.0)  # (BM, BK)
        wt = tl.load(w_rows + k[None, :], mask=w_ok, other=0.0)  # (BN, BK)
        if F32_DOT:  # the CPU interpreter multiplies bf16's raw bits (see paged_decode.f32_dot)
            a, wt = a.to(tl.float32), wt.to(tl.float32)
        acc = tl.dot(a, tl.trans(wt), acc, input_precision="ieee")
        if SWIGLU:
            wu = tl.load(w_rows + n_out * sw + k[None, :], mask=w_ok, other=0.0)
            if F32_DOT:
                wu = wu.to(tl.float32)
            acc_up = tl.dot(a, tl.trans(wu), acc_up, input_precision="ieee")
    ok = row_ok[:, None] & col_ok[None, :]
    if DIRECT:
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if SWIGLU:
            y = _silu_mul_round(acc, acc_up, out_ptr.dtype.element_ty)
        else:
            y = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * so + cols[None, :], y, mask=ok)
    else:  # partials (S, M, N): gate columns then up columns
        base = part_ptr + split.to(tl.int64) * M * N + rows.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(base, acc, mask=ok)
        if SWIGLU:
            tl.store(base + n_out, acc_up, mask=ok)


@triton.jit
def _reduce_kernel(part_ptr, b_ptr, out_ptr, M, N, n_out, splits, so,
                   HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out[r, c] = sum over splits in order (+ bias, or SwiGLU of gate and up), rounded once."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < M * n_out
    r, c = idx // n_out, idx % n_out
    acc = tl.zeros([BLOCK], tl.float32)
    up = tl.zeros([BLOCK], tl.float32)
    for s in range(0, splits):
        base = part_ptr + s * M * N + r * N + c
        acc += tl.load(base, mask=ok, other=0.0)
        if SWIGLU:
            up += tl.load(base + n_out, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + c, mask=ok, other=0.0).to(tl.float32)
    if SWIGLU:
        y = _silu_mul_round(acc, up, out_ptr.dtype.element_ty)
    else:
        y = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + r * so + c, y, mask=ok)


def _gemm_triton(x, w, bias, swiglu: bool, config: GemmConfig | None, pdl: bool | None = None,
                 prefetch: bool | None = None):
    m, k = x.shape
    n = w.shape[0]
    n_out = n // 2 if swiglu else n
    out = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = config or gemm_config(m, n_out, k, x.device)
    k_tiles = triton.cdiv(k, cfg.block_k)
    per_split = triton.cdiv(k_tiles, cfg.splits)
    splits = triton.cdiv(k_tiles, per_split)  # no empty split
    part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else out
    b = bias if bias is not None else out
    pdl = pdl_usable(x.device) if pdl is None else pdl
    prefetch = pdl if prefetch is None else prefetch
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n_out, cfg.block_n), splits)
    _gemm_kernel[grid](x, w, b, out, part, m, n, k, n_out, x.stride(0), w.stride(0), out.stride(0), per_split,
                       HAS_BIAS=bias is not None, SWIGLU=swiglu, DIRECT=splits == 1, EVEN_K=k % cfg.block_k == 0,
                       BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, F32_DOT=f32_dot(x.dtype),
                       PDL=pdl, PREFETCH=prefetch, ELEMS_PER_LINE=128 // x.element_size(),
                       num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_pdl_launch(pdl))
    if splits > 1:
        _reduce_kernel[(triton.cdiv(m * n_out, REDUCE_BLOCK),)](
            part, b, out, m, n, n_out, splits, out.stride(0), HAS_BIAS=bias is not None, SWIGLU=swiglu,
            BLOCK=REDUCE_BLOCK, PDL=pdl, num_warps=4, **_pdl_launch(pdl))
    return out


def _pdl_launch(pdl: bool) -> dict:
    return {"launch_pdl": True} if pdl else {}


def _check(x, w, bias, op: str):
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"{op}: want x (M, K) and w (N, K); got {tuple(x.shape)}, {tuple(w.shape)}")
    if x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError(f"{op}: x and w need unit stride in K")
    if x.dtype != w.dtype:
        raise ValueError(f"{op}: x and w dtypes differ: {x.dtype}, {w.dtype}")
    if bias is not None and tuple(bias.shape) != (w.shape[0],):
        raise ValueError(f"{op}: bias must be ({w.shape[0]},), got {tuple(bias.shape)}")


def _use_triton(backend: str, x, *tensors) -> bool:
    resolved = choose(backend, x, *tensors)
    if backend == "auto":
        return resolved == "triton" and x.shape[0] <= MAX_ROWS
    return resolved == "triton"


def decode_linear(x, w, bias=None, backend: str = "auto", config: GemmConfig | None = None,
                  pdl: bool | None = None, prefetch: bool | None = None):
    """(M, K) @ (N, K).T (+ bias) -> (M, N); see the module docstring. pdl / prefetch: override
    `pdl_usable` (programmatic dependent launch) and the L2 weight prefetch (default: with PDL)."""
    _check(x, w, bias, "decode_linear")
    extra = (w,) if bias is None else (w, bias)
    if _use_triton(backend, x, *extra):
        return _gemm_triton(x, w, bias, False, config, pdl, prefetch)
    return decode_linear_ref(x, w, bias)


def decode_swiglu(x, w, backend: str = "auto", config: GemmConfig | None = None,
                  pdl: bool | None = None, prefetch: bool | None = None):
    """(M, K), [gate | up] (2F, K) -> (M, F) = silu(x @ gate.T) * (x @ up.T), `silu_mul`'s rounding."""
    _check(x, w, None, "decode_swiglu")
    if w.shape[0] % 2:
        raise ValueError(f"decode_swiglu: w must have 2F rows [gate | up], got {w.shape[0]}")
    if _use_triton(backend, x, w):
        return _gemm_triton(x, w, None, True, config, pdl, prefetch)
    return silu_mul(F.linear(x, w), backend=backend if backend != "ref" else "torch")
