"""Which program of the decode attention reads which key tiles: its launch shape and work plan.

A decode step's rows can differ a lot in length (a ragged batch holds rows of 16 and of
1,000+ keys). One program per row made the step wait for its longest rows: a ragged batch's
attention cost 1.4x that of uniform rows of the same mean length (docs/performance.md). The plan
cuts every row into segments of at most c key tiles, c = the mean tiles per target program,
and orders them largest first: the full segments of every row, then the rows' remainders.
The GPU's block scheduler hands the next segment to whichever program slot frees first, so
the long rows no longer finish last. With rows of equal length each row is one segment: the
one-program-per-row launch. The kernel takes one segment per program and no loop over rows
(a loop around the tile loop tripled its registers: one program per SM instead of two).

Spec (`decode_plan_ref`). tiles_b = max(1, cdiv(seq_lens[b], BLOCK_N)) (a row without keys still
gets a tile: its program writes the row's zeros and its K/V to the scratch page); T = sum tiles;
c = max(1, cdiv(T, target)); row b has q_b = tiles_b // c full segments and, if
r_b = tiles_b % c > 0, a remainder. Segment numbers: the full segments of rows 0, 1, ... in
order, then the remainders in row order; there are at most T / c + B <= target + B of them,
the launch's segment count S (programs past the last segment do nothing).
    rows (B, 4) int32      first full segment, q_b, the remainder's segment (-1: none), tiles_b
    segments (S, 3) int32  row (-1: none), first tile, end tile (of the row's tiles)
A row read by several segments is merged, in segment order, by the last of them to finish.
Made on the device by one one-program launch (`_plan_kernel`), once per decode step and shared
by its layers; nothing comes back to the host (graph capturable).

Launch shape (`decode_launch`), from shapes alone (never from seq_lens): the target programs
(per kv head) are B once B * Hkv programs fill the SMs (128-key tiles on 8 warps while at most
WIDE_ROWS_PER_SM of them share an SM, else 64-key tiles on 4 warps); fewer rows: PROGRAMS_PER_SM
* SMs / Hkv, at most MAX_SPLITS per row and a tile pair of the longest possible row
(max_seqlen_k) per program, as a whole number of segments per row. S = B + target.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from megarl_kernels.dispatch import next_pow2, tl, triton

# Launch shape. Every setting below is correct for any shape (the tests run several); they only set
# speed. They were chosen by sweeping `benchmarks/bench_attention.py` and the decode step's own call
# on the Qwen2.5-1.5B layer (Hq 12, Hkv 2, D 128, bf16, page 16) at B = 32 / 128 / 256 / 512 and
# 128..640 keys a row (tables in docs/performance.md). Other shapes get the same rules, which are
# stated in programs and SMs, not in batch sizes: wider heads shrink BLOCK_N to fit SMEM_BUDGET,
# other GPUs read their SM count, and a batch that does not fill the SMs is split further.
# Keys per loop step and launch shape of the split kernel (batches that fill the GPU, or wide
# heads): the best of 27 (BLOCK_N x warps x stages) within 2% at every batch size.
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 2
# Programs at small batch: aim at PROGRAMS_PER_SM * (SM count), at most MAX_SPLITS per row, and
# at least MIN_TILES_PER_SPLIT key tiles of the longest possible row (max_seqlen_k) per program.
# 1 program per SM is slower at small batch, 4 or more slower at B = 128; MIN_TILES_PER_SPLIT 4 is
# slower at B = 32.
PROGRAMS_PER_SM = 2
# One program per row once B * Hkv programs fill the SMs, and then 128-key tiles on 8 warps while
# there are at most WIDE_ROWS_PER_SM programs per SM (such a program takes 72 KiB of shared memory
# and 80-94 registers a thread: two fit an SM). With more rows per SM the 64-key tiles on 4 warps
# win again (more programs resident).
WIDE_ROWS_PER_SM = 2
WIDE_BLOCK_N = 128
WIDE_NUM_WARPS = 8
MAX_SPLITS = 32  # not tuned: the bound only binds for B * Hkv < 9 on a GPU of 132 SMs
MIN_TILES_PER_SPLIT = 2
CPU_SM_COUNT = 4  # interpreter runs: a stand-in SM count
# K + V tiles of all pipeline stages must fit in shared memory (227 KiB per SM on Hopper);
# BLOCK_N shrinks for wide heads (fp32 D=256: 32 keys at 2 stages).
SMEM_BUDGET = 160 << 10
# Rows the plan kernel's one compiled variant covers (more: one more compile per power of two). A
# variant per batch bucket was compiled inside a run's first mixed steps, which then stalled.
PLAN_ROWS = 1024


@dataclass(frozen=True)
class DecodeLaunch:
    """The decode kernel's grid (Hkv, segments) and tile shape."""

    target: int  # programs per kv head the rows' tiles are spread over
    segments: int  # S = B + target, the grid's second dimension (an upper bound on the segments)
    block_n: int  # keys per tile
    warps: int
    stages: int  # software-pipeline stages of the tile loop


@dataclass
class DecodePlan:
    """Which tiles each program reads (module docstring), for one call's seq_lens."""

    launch: DecodeLaunch
    rows: torch.Tensor  # (B, 4) int32: first full segment, full segments, remainder segment (-1: none), tiles
    segments: torch.Tensor  # (S, 3) int32: row (-1: none), first tile, end tile


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return CPU_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count


def fit_keys(block_n: int, block_d: int, itemsize: int, stages: int) -> int:
    """block_n halved (not below 16) until `stages` K and V tiles fit SMEM_BUDGET."""
    while block_n > 16 and 2 * max(stages, 1) * block_n * block_d * itemsize > SMEM_BUDGET:
        block_n //= 2
    return block_n


def decode_launch(batch: int, k_cache: torch.Tensor, max_seqlen_k: int, programs: int | None = None) -> DecodeLaunch:
    """The launch shape for ``batch`` rows over ``k_cache`` (P, page, Hkv, D) whose rows never exceed
    ``max_seqlen_k`` keys (module docstring); ``programs`` overrides the target (tests)."""
    _, _, hkv, d = k_cache.shape
    block_d, itemsize, sms = max(16, next_pow2(d)), k_cache.element_size(), sm_count(k_cache.device)
    block_n, warps = fit_keys(BLOCK_N, block_d, itemsize, NUM_STAGES), NUM_WARPS
    if batch * hkv >= sms:  # the rows alone fill every SM (see WIDE_ROWS_PER_SM)
        want = batch
        if batch * hkv <= WIDE_ROWS_PER_SM * sms:
            block_n, warps = fit_keys(WIDE_BLOCK_N, block_d, itemsize, NUM_STAGES), WIDE_NUM_WARPS
    else:
        pairs = triton.cdiv(triton.cdiv(max(max_seqlen_k, 1), block_n), MIN_TILES_PER_SPLIT)
        want = batch * min(triton.cdiv(PROGRAMS_PER_SM * sms, batch * hkv), MAX_SPLITS, pairs)  # segments a row
    target = max(1, programs or want)
    return DecodeLaunch(target, batch + target, block_n, warps, NUM_STAGES)


def decode_plan_ref(seq_lens: torch.Tensor, block_n: int, target: int, segments: int):
    """The spec: (rows (B, 4), segments (S, 3)) int32, for B >= 1 rows."""
    tiles = torch.clamp((seq_lens.long() + block_n - 1) // block_n, min=1)
    c = max(1, -(-int(tiles.sum()) // target))
    full, rem = tiles // c, tiles % c
    first_full = torch.cumsum(full, 0) - full
    has_rem = rem > 0
    rem_seg = torch.where(has_rem, int(full.sum()) + torch.cumsum(has_rem.long(), 0) - has_rem.long(), -1)
    segs = torch.tensor([[-1, 0, 0]] * segments)
    for b in range(tiles.shape[0]):
        for k in range(int(full[b])):
            segs[first_full[b] + k] = torch.tensor([b, k * c, (k + 1) * c])
        if has_rem[b]:
            segs[rem_seg[b]] = torch.tensor([b, full[b] * c, tiles[b]])
    return torch.stack([first_full, full, rem_seg, tiles], 1).int(), segs.int().to(seq_lens.device)


@triton.jit(do_not_specialize=["n_rows", "n_segs", "target"])  # one compiled plan kernel for every batch
def _plan_kernel(len_ptr, rows_ptr, segs_ptr, n_rows, n_segs, target, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
                 BLOCK_S: tl.constexpr):
    """One program, vectorized over the rows: their tiles, c, the full segments' and remainders'
    numbers (cumsums), then each row writes its segments (a loop over the most full segments of a row)."""
    i = tl.arange(0, BLOCK_B)
    ok = i < n_rows
    lens = tl.load(len_ptr + i, mask=ok, other=0)
    tiles = tl.where(ok, tl.maximum((lens + BLOCK_N - 1) // BLOCK_N, 1), 0).to(tl.int32)
    c = tl.maximum((tl.sum(tiles, 0) + target - 1) // target, 1)
    full = tiles // c
    has_rem = (tiles - full * c > 0).to(tl.int32)
    first_full = tl.cumsum(full, 0) - full
    n_full = tl.sum(full, 0)
    rem_seg = tl.where(has_rem > 0, n_full + tl.cumsum(has_rem, 0) - has_rem, -1)
    row = rows_ptr + i * 4
    tl.store(row, first_full, mask=ok)
    tl.store(row + 1, full, mask=ok)
    tl.store(row + 2, rem_seg, mask=ok)
    tl.store(row + 3, tiles, mask=ok)
    j = tl.arange(0, BLOCK_S)  # the segments past the last one: none
    none = (j >= n_full + tl.sum(has_rem, 0)) & (j < n_segs)
    tl.store(segs_ptr + j * 3, -1, mask=none)
    tl.store(segs_ptr + j * 3 + 1, 0, mask=none)
    tl.store(segs_ptr + j * 3 + 2, 0, mask=none)
    for k in range(0, tl.max(full, 0)):
        seg = segs_ptr + (first_full + k) * 3
        mine = ok & (k < full)
        tl.store(seg, i, mask=mine)
        tl.store(seg + 1, k * c, mask=mine)
        tl.store(seg + 2, (k + 1) * c, mask=mine)
    seg = segs_ptr + rem_seg * 3
    tl.store(seg, i, mask=has_rem > 0)
    tl.store(seg + 1, full * c, mask=has_rem > 0)
    tl.store(seg + 2, tiles, mask=has_rem > 0)


def decode_plan(seq_lens: torch.Tensor, k_cache: torch.Tensor, max_seqlen_k: int,
                programs: int | None = None) -> DecodePlan:
    """The plan of a decode call over ``seq_lens`` (B,) (B >= 1) rows of ``k_cache`` (one launch);
    ``programs`` overrides the launch's target (tests)."""
    batch = seq_lens.shape[0]
    launch = decode_launch(batch, k_cache, max_seqlen_k, programs)
    rows = torch.empty(batch, 4, dtype=torch.int32, device=seq_lens.device)
    segs = torch.empty(launch.segments, 3, dtype=torch.int32, device=seq_lens.device)
    _plan_kernel[(1,)](seq_lens, rows, segs, batch, launch.segments, launch.target, BLOCK_N=launch.block_n,
                       BLOCK_B=max(PLAN_ROWS, next_pow2(batch)), BLOCK_S=max(2 * PLAN_ROWS, next_pow2(launch.segments)),
                       num_warps=4)
    return DecodePlan(launch, rows, segs)
