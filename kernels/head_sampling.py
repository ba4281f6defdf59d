"""The output layer and the sampler's first pass in one kernel, for decode-sized batches.

Spec (`sample_head_ref`). h (M, K) final-normed hidden states, w (V, K) the output layer (rows
past vocab_size n are padding) -> `sample_tokens(F.linear(h, w), ...)`: tokens (M,) int64 and
log-probs (M,) fp32, under the same per-row temperature, top-k, top-p, seeds and offsets.

Why. A decode step's head GEMM streams the (V, K) weight (467 MB on the Qwen2.5-1.5B shape) and
writes the (M, V) logits, which the sampler's first launch then reads back and hashes (the
per-request noise, two logs per element: `sampling.py`). At M = 128 on an H200 these were 125 +
53 us of a 2.16 ms step (RESULTS.md, session 19); the GEMM is bound by the weight stream and leaves
the ALUs idle, the sampler is bound by its ALU work.

Kernel (`_head_partials_kernel`): program v owns BLOCK_V vocab rows. It streams their weights
through a TMA ring (host tensor descriptors; the weights on the MMA's M side, the batch rows on
its N side, as `fc1_swiglu.py`), rounds the fp32 sums to h.dtype as F.linear's output, writes
those logits, and reduces its (BLOCK_V, rows) tile into exactly the sampler's first-launch
partials (`sampling.partials_buffers`: per row and slice the max, sum of exp, race max and their
indices, min key): the slice is the program's BLOCK_V columns. Then `sampling.finish` merges them
as it does its own (filtered rows bisect over the written logits). So tokens equal
`sample_tokens` of those logits exactly; log-probs to rounding (the sum of exp merges 1,187
slices instead of 10). The logits equal F.linear's up to the fp32 summation order. BLOCK_V is
fixed, so a row's slices (and bits) do not depend on the batch. Launched as a programmatic
dependent of the final norm on Hopper (the norm lets dependents start at once, `rms_norm.py`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megarl.kernels.dispatch import choose, hopper_or_newer, interpret_mode, next_pow2, tl, triton
from megarl.kernels.paged_decode import f32_dot
from megarl.kernels.sampling import _key, finish, partials_buffers, race_values, row_settings, sample_tokens
from megarl.kernels.sampling_noise import row_keys

BLOCK_V = 128  # vocab rows per program: the sampler's slice, so fixed for every batch (bits do not move)
BLOCK_K = 64
# (STAGES, NUM_WARPS, CHUNK) by the row tile (the next power of two >= M, at least 16). H200
# (2026-12-04, RESULTS.md session 24), us per final norm + head + sampler, cuBLAS + `sample_tokens`
# 145 / 160 / 190 at M = 32 / 64 / 128. The first form (the epilogue on the whole register tile):
# 141.6 at M = 32 (5 stages, 8 warps), 188-254 at 64, 332-786 at 128. The chunked epilogue: unswept.
TILES = {16: (4, 4, 16), 32: (4, 8, 16), 64: (3, 8, 16), 128: (3, 8, 16)}
MAX_ROWS = 128


def sample_head_ref(h, w, temperature, top_k, top_p, seeds, offsets, vocab_size=None):
    """The spec: the output layer, then `sample_tokens` (torch backend)."""
    return sample_tokens(F.linear(h, w), temperature, top_k, top_p, seeds, offsets, vocab_size=vocab_size,
                         backend="torch")


@triton.jit
def _slice_partials(logit, j, ok, inv_t, k1, k2, FAST_LOG: tl.constexpr):
    """One slice's partials per row of ``logit`` (R, BLOCK_V) rounded logits: j, ok (1, BLOCK_V) vocab
    ids and mask, inv_t, k1, k2 (R, 1) row settings."""
    s = tl.where(ok, logit.to(tl.float32) * inv_t, float("-inf"))  # scaled logits
    m = tl.max(s, 1)  # every slice holds a real column (the grid is cdiv(n, BLOCK_V))
    z = tl.sum(tl.exp(s - m[:, None]), 1)
    big = 2147483647
    am = tl.min(tl.where(ok & (s == m[:, None]), j, big), 1)
    mn = tl.min(tl.where(ok, _key(s), big), 1)
    r = race_values(s, ok, j, k1, k2, FAST_LOG)
    rb = tl.max(r, 1)
    ri = tl.min(tl.where(ok & (r == rb[:, None]), j, big), 1)
    return m, z, rb, am, ri, mn


@triton.jit
def _head_partials_kernel(x_desc, w_desc, logits_ptr, stride_l, n, M, K, temp_ptr, seed_ptr, off_ptr, pf_ptr, pi_ptr,
                          BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                          CHUNK: tl.constexpr, F32_DOT: tl.constexpr, FAST_LOG: tl.constexpr,
                          DEPENDENT: tl.constexpr):
    """Program v: vocab rows [v * BLOCK_V, (v + 1) * BLOCK_V) for every batch row. The GEMM holds the tile
    transposed, (BLOCK_V, BLOCK_M), and writes it as logits; the partials are then made from those
    logits read back (L2-hot, this program's own writes) CHUNK rows at a time, so the epilogue's
    registers are a chunk's, not the tile's: two programs fit an SM and one streams while the other
    hashes (the whole tile at once needed 128-255 registers a thread: one program an SM, the epilogue
    never hidden; RESULTS.md session 24)."""
    sp = tl.program_id(0)
    S = tl.num_programs(0)
    v0 = sp * BLOCK_V
    if DEPENDENT:  # launched before the final norm that writes h ends: wait for its writes
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros([BLOCK_V, BLOCK_M], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        x = x_desc.load([0, k0])  # (BM, BK); rows past M read as zero
        w = w_desc.load([v0, k0])  # (BV, BK); rows past V read as zero
        if F32_DOT:  # the CPU interpreter multiplies bf16's raw bits (`f32_dot`)
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(w, x.T, acc)
    jt = v0 + tl.arange(0, BLOCK_V)[:, None]
    rt = tl.arange(0, BLOCK_M)[None, :]
    tl.store(logits_ptr + rt.to(tl.int64) * stride_l + jt, acc.to(logits_ptr.dtype.element_ty),
             mask=(jt < n) & (rt < M))  # F.linear's rounding
    tl.debug_barrier()  # every thread's logits written before any is read back
    j = v0 + tl.arange(0, BLOCK_V)[None, :]  # (1, BV)
    ok = j < n
    for r0 in range(0, M, CHUNK):
        rows = r0 + tl.arange(0, CHUNK)
        live = rows < M
        logit = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_l + j, mask=live[:, None] & ok, other=0.0)
        t = tl.load(temp_ptr + rows, mask=live, other=1.0)
        inv_t = tl.math.div_rn(1.0, tl.where(t <= 0.0, 1.0, t))  # as `sampling._row_setup`
        k1, k2 = row_keys(tl.load(seed_ptr + rows, mask=live, other=0), tl.load(off_ptr + rows, mask=live, other=0))
        m, z, rb, am, ri, mn = _slice_partials(logit, j, ok, inv_t[:, None], k1[:, None], k2[:, None], FAST_LOG)
        o = rows * S + sp  # (3, M, S) partials, as `sampling._partials_kernel` writes them
        tl.store(pf_ptr + o, m, mask=live)
        tl.store(pf_ptr + M * S + o, z, mask=live)
        tl.store(pf_ptr + 2 * M * S + o, rb, mask=live)
        tl.store(pi_ptr + o, am, mask=live)
        tl.store(pi_ptr + M * S + o, ri, mask=live)
        tl.store(pi_ptr + 2 * M * S + o, mn, mask=live)


def fits_kernel(h: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the kernel's tiles take these shapes (else the spec runs)."""
    m, k = h.shape
    dense = h.stride(-1) == 1 and w.stride(-1) == 1 and h.stride(0) % 8 == 0 and w.stride(0) % 8 == 0
    half = h.dtype in (torch.bfloat16, torch.float16) and w.dtype == h.dtype  # fp32 would run as TF32
    if h.is_cuda and not hopper_or_newer(h):  # host tensor descriptors (TMA): sm_90+
        return False
    return 0 < m <= MAX_ROWS and k % BLOCK_K == 0 and dense and half  # 8: TMA's 16 B


def head_partials(h, w, rows, n: int, tiles: tuple[int, int, int] | None = None):
    """The fused first launch: (M, n) logits in h.dtype and the sampler's (3, M, S) partials (pf, pi);
    rows: `sampling.row_settings`; tiles = (STAGES, NUM_WARPS, CHUNK) (default `TILES`)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = h.shape
    block_m = max(16, next_pow2(m))
    stages, num_warps, chunk = tiles or TILES[block_m]
    S = triton.cdiv(n, BLOCK_V)
    logits = h.new_empty((m, n))
    pf, pi = partials_buffers(m, S, h.device)
    dependent = hopper_or_newer(h)
    _head_partials_kernel[(S,)](
        TensorDescriptor.from_tensor(h, [block_m, BLOCK_K]), TensorDescriptor.from_tensor(w, [BLOCK_V, BLOCK_K]),
        logits, logits.stride(0), n, m, k, rows[0], rows[3], rows[4], pf, pi, BLOCK_M=block_m, BLOCK_V=BLOCK_V,
        BLOCK_K=BLOCK_K, STAGES=stages, CHUNK=chunk, F32_DOT=f32_dot(h.dtype),
        FAST_LOG=not interpret_mode(), DEPENDENT=dependent, num_warps=num_warps, launch_pdl=dependent)
    return logits, pf, pi


def sample_head_triton(h, w, temperature, top_k, top_p, seeds, offsets, n: int, out=None,
                       tiles: tuple[int, int, int] | None = None):
    """`head_partials`, then `sampling.finish` (two launches); out as in `sample_tokens`."""
    rows = row_settings(temperature, top_k, top_p, seeds, offsets)
    logits, pf, pi = head_partials(h, w, rows, n, tiles)
    if out is not None:
        tokens, logprobs = out[0], out[1]
    else:
        tokens = torch.empty(h.shape[0], dtype=torch.int64, device=h.device)
        logprobs = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
    finish(logits, n, rows, pf, pi, tokens, logprobs)
    return tokens, logprobs


def sample_head(h, w, temperature, top_k, top_p, seeds, offsets, vocab_size=None, backend: str = "auto", out=None):
    """Tokens and log-probs of `sample_tokens(F.linear(h, w), ...)` (module docstring): h (M, K), w (V, K),
    the row settings (M,) as `sample_tokens` takes them, vocab_size <= V, out as there. The fused kernel
    where chosen and it fits (`fits_kernel`), else the output layer then `sample_tokens`."""
    if h.dim() != 2 or w.dim() != 2 or w.shape[1] != h.shape[1]:
        raise ValueError(f"sample_head: h (M, K) and w (V, K) expected; got {tuple(h.shape)}, {tuple(w.shape)}")
    n, m = w.shape[0] if vocab_size is None else int(vocab_size), h.shape[0]
    if any(t.shape != (m,) for t in (temperature, top_k, top_p, seeds, offsets)) or not 0 < n <= w.shape[0]:
        raise ValueError(f"sample_head wants temperature, top_k, top_p, seeds, offsets ({m},) and vocab_size in "
                         f"[1, {w.shape[0]}]; got {vocab_size} and " + ", ".join(
                             str(tuple(t.shape)) for t in (temperature, top_k, top_p, seeds, offsets)))
    impl = choose(backend, h, w, temperature, seeds)
    if impl == "triton" and fits_kernel(h, w):
        if out is not None and (out.shape != (2, m) or out.dtype != torch.float32 or out.stride(1) != 1):
            raise ValueError(f"sample_head: out must be (2, {m}) fp32 with unit-stride rows, "
                             f"got {tuple(out.shape)} {out.dtype}")
        return sample_head_triton(h, w, temperature, top_k, top_p, seeds, offsets, n, out=out)
    backend = {"triton": "triton", "ref": "ref"}.get(impl, "torch")
    return sample_tokens(F.linear(h, w), temperature, top_k, top_p, seeds, offsets, vocab_size=vocab_size,
                         backend=backend, out=out)
