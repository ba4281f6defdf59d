"""Paged KV-cache attention, decode: one new query token per sequence.

Spec (`paged_decode_attention_ref`). q (B, Hq, D); k_cache, v_cache (P, page, Hkv, D); key j
of row b sits at k_cache[block_table[b, j // page], j % page]; seq_lens (B,) keys per row (the
query's own key included, so no causal mask). Query head h reads kv head h // G, G = Hq / Hkv:
    out[b, h] = softmax(scale * K_b q[b, h]) V_b        over keys 0 .. seq_lens[b] - 1
softmax in fp32, out in q.dtype; a row with no keys gives zeros.

Kernel (flash decoding over a work plan). Grid (Hkv, S). `decode_plan.py` cuts every row into
segments of at most c key tiles (BLOCK_N keys each), largest first, so a ragged batch's long rows
are read by several programs and no longer finish last; uniform rows stay one segment each.
Program (kvh, p) reads segment p's tiles once for all G query heads of kvh (one (BLOCK_G, D) x
(D, BLOCK_N) tl.dot, G padded to BLOCK_G >= 16 rows) and keeps the running max m, sum l and
acc in fp32 (exp2, scale folded in). A row of one segment is written out directly; a row of
several writes o = acc / l and lse = m + log2 l per segment to fp32 scratch ((Hkv, S, G, D) and
(Hkv, S, G)), and the last of them to finish (an arrival counter per (b, kvh),
`split_semaphores`, zeroed again by that program) merges them in segment order, so the result
does not depend on which finished last:
    out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M),   M = max_s lse_s
One launch after the plan's; nothing is read back on the host and every allocation is sized
from shapes: CUDA-graph capturable. A decode step makes its plan once for all its layers.

`rope_paged_decode` is the decode step's `rope_cache` + this attention in the same launch:
each program RoPEs its group's queries from the fused QKV row itself, and the program whose
segment holds the row's last tile writes this step's key and value into the cache before it
reads its tiles. The key-tile loop (`_decode_span`: `_attend_span` with each tile's page ids
loaded a step ahead, the first tile's before the RoPE chain) reads that key back from the cache:
an earlier fusion that kept the new key in registers inside the loop doubled the kernel's
registers and lost (docs/performance.md).

`check_paged`, `sequence_keys`, `sdpa_fp32` and the `_attend_span` loop are shared with
`paged_prefill.py`.
"""
import math

import torch
import torch.nn.functional as F

from megarl_kernels.decode_plan import DecodePlan, decode_plan
from megarl_kernels.dispatch import choose, interpret_mode, next_pow2, tl, triton
from megarl_kernels.memo import remembered
from megarl_kernels.rms_norm import sum_parts_ref
from megarl_kernels.rope_cache import check_rope_inputs, qkv_values, rope_cache_ref, rope_rows, rope_tables

LOG2E = math.log2(math.e)
MIN_SEMAPHORES = 1 << 16  # split counters allocated at first use: B * Hkv up to 65,536 (256 KiB)
_SEMAPHORES: dict = {}  # (device type, index) -> int32 split counters (`split_semaphores`)
_SEMAPHORES_KEPT: list = []  # outgrown counters: graphs captured on them still replay


# ---- shared by decode and prefill ----

def check_paged(q, k_cache, v_cache, block_table, seq_lens, n_rows: int, op: str):
    """Shape / dtype checks (nothing read from the device). Returns G = Hq // Hkv."""
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"{op}: k_cache, v_cache must both be (num_pages, page_size, Hkv, D); got "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    _, page, hkv, d = k_cache.shape
    if q.shape[-1] != d or q.shape[-2] % hkv:
        raise ValueError(f"{op}: q (..., Hq, D) = {tuple(q.shape)} needs D = {d} and Hq a multiple of Hkv = {hkv}")
    if not q.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"{op}: q, k_cache, v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if page & (page - 1):
        raise ValueError(f"{op}: page_size = {page} must be a power of two")
    if block_table.dim() != 2 or block_table.shape[0] != n_rows or tuple(seq_lens.shape) != (n_rows,):
        raise ValueError(f"{op}: want block_table ({n_rows}, max_pages) and seq_lens ({n_rows},); got "
                         f"{tuple(block_table.shape)}, {tuple(seq_lens.shape)}")
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{op}: {name} must be int32 (or int64), got {t.dtype}")
    return q.shape[-2] // hkv


def sequence_keys(cache, table_row, n: int):
    """Keys (or values) 0..n-1 of one sequence: (P, page, Hkv, D), (max_pages,) -> (n, Hkv, D)."""
    pos = torch.arange(n, device=cache.device)
    return cache[table_row[pos // cache.shape[1]].long(), pos % cache.shape[1]]


def sdpa_fp32(q, k, v, visible, scale: float):
    """SDPA in fp32 with GQA: q (..., Hq, M, D), k, v (..., Hkv, N, D), visible (..., 1, M, N) bool, or an
    fp32 additive mask (0 where visible, -inf elsewhere)."""
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=visible, scale=scale,
                                          enable_gqa=k.shape[-3] != q.shape[-3])


def unit_last_stride(*tensors):
    """The tensors with stride 1 in their last dim (copied only where it is not)."""
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


@triton.jit
def _page_ids(bt_row, n, ok, PAGE: tl.constexpr):
    """(BLOCK_N,) int64 page of each key position n of one sequence (page 0 where not ok)."""
    return tl.load(bt_row + n // PAGE, mask=ok, other=0).to(tl.int64)


@triton.jit
def _kv_tile(cache_ptr, page, n, ok, kvh, s_page, s_tok, s_head,
             PAGE: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr):
    """(BLOCK_N, BLOCK_D) cache rows of key positions n (BLOCK_N,) on pages `page`; 0 where not ok."""
    d = tl.arange(0, BLOCK_D)
    off = page * s_page + (n % PAGE) * s_tok + kvh * s_head  # (BN,)
    return tl.load(cache_ptr + off[:, None] + d[None, :], mask=ok[:, None] & (d < HEAD_D)[None, :], other=0.0)


@triton.jit
def _softmax_step(q, k, v, visible, m, l, acc, qk_scale, F32_DOT: tl.constexpr):
    """One online-softmax step: q (R, BD), k, v (BN, BD), visible (R, BN); m, l (R,), acc (R, BD)."""
    if F32_DOT:  # see `f32_dot`
        q, k, v = q.to(tl.float32), k.to(tl.float32), v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # (R, BN) fp32, log2 units
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(s - m_use[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l * alpha + tl.sum(p, 1), acc


@triton.jit
def _attend_span(q, m, l, acc, pos, lo, hi, step, bt_row, k_ptr, v_ptr, kvh, sk_p, sk_t, sk_h, sv_p, sv_t, sv_h,
                 qk_scale, CAUSAL: tl.constexpr, PAGE: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_N: tl.constexpr, F32_DOT: tl.constexpr):
    """Online softmax over the key tiles [n0, n0 + BLOCK_N), n0 = lo, lo + step, ... < hi (keys < hi).

    CAUSAL: row r sees key n only if n <= pos[r]. Returns the updated (m, l, acc).
    """
    for n0 in range(lo, hi, step):
        n = n0 + tl.arange(0, BLOCK_N)
        live = n < hi
        page = _page_ids(bt_row, n, live, PAGE)
        k = _kv_tile(k_ptr, page, n, live, kvh, sk_p, sk_t, sk_h, PAGE, HEAD_D, BLOCK_D)
        v = _kv_tile(v_ptr, page, n, live, kvh, sv_p, sv_t, sv_h, PAGE, HEAD_D, BLOCK_D)
        visible = live[None, :]
        if CAUSAL:
            visible = visible & (n[None, :] <= pos[:, None])  # (R, BN)
        m, l, acc = _softmax_step(q, k, v, visible, m, l, acc, qk_scale, F32_DOT)
    return m, l, acc


@triton.jit
def _decode_span(q, page, lo, hi, keys, page_end, bt_row, k_ptr, v_ptr, kvh, sk_p, sk_t, sk_h, sv_p, sv_t, sv_h,
                 qk_scale, PAGE: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_N: tl.constexpr, F32_DOT: tl.constexpr):
    """`_attend_span` for one decode segment: tiles [lo, hi) (keys), keys n < ``keys`` live, from a
    fresh online softmax. ``page``: the first tile's page ids, loaded by the caller before the
    queries are made; each step loads the next tile's (positions < ``page_end``) a step ahead, so no
    K/V load waits on a page-id load. Returns (m, l, acc)."""
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        live = n < keys
        k = _kv_tile(k_ptr, page, n, live, kvh, sk_p, sk_t, sk_h, PAGE, HEAD_D, BLOCK_D)
        v = _kv_tile(v_ptr, page, n, live, kvh, sv_p, sv_t, sv_h, PAGE, HEAD_D, BLOCK_D)
        page = _page_ids(bt_row, n + BLOCK_N, n + BLOCK_N < page_end, PAGE)
        m, l, acc = _softmax_step(q, k, v, live[None, :], m, l, acc, qk_scale, F32_DOT)
    return m, l, acc


def f32_dot(dtype: torch.dtype) -> bool:
    """Upcast tl.dot operands to fp32: the CPU interpreter (Triton 3.9) multiplies bf16's raw bits."""
    return dtype == torch.bfloat16 and interpret_mode()


# ---- decode: reference and torch ----

def paged_decode_attention_ref(q, k_cache, v_cache, block_table, seq_lens, scale: float):
    """The spec: a loop over rows and heads in fp32. Returns (B, Hq, D) in q.dtype."""
    B, Hq, D = q.shape
    G = Hq // k_cache.shape[2]
    out = torch.zeros(B, Hq, D, dtype=torch.float32, device=q.device)
    for b in range(B):
        n = int(seq_lens[b])
        k = sequence_keys(k_cache, block_table[b], n).float()  # (n, Hkv, D)
        v = sequence_keys(v_cache, block_table[b], n).float()
        for h in range(Hq if n else 0):
            w = torch.softmax(k[:, h // G] @ q[b, h].float() * scale, dim=0)  # (n,)
            out[b, h] = w @ v[:, h // G]
    return out.to(q.dtype)


def paged_decode_attention_torch(q, k_cache, v_cache, block_table, seq_lens, scale: float):
    """Vectorized: gather every row's max_pages * page slots, mask those >= seq_len, one SDPA.

    Dead slots are gathered from the row's first key instead (they may hold NaN, and a masked
    NaN still poisons SDPA's p @ v); a row with no keys is zeroed at the end.
    """
    B, Hq, D = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    n = block_table.shape[1] * page
    if B == 0 or n == 0:
        return torch.zeros_like(q)
    slot, mask = _gather_plan(block_table, seq_lens, page)
    k = k_cache.reshape(-1, hkv, D).index_select(0, slot).view(B, n, hkv, D).transpose(1, 2)  # (B, Hkv, N, D)
    v = v_cache.reshape(-1, hkv, D).index_select(0, slot).view(B, n, hkv, D).transpose(1, 2)
    out = sdpa_fp32(q[:, :, None], k, v, mask, scale)[:, :, 0]  # (B, Hq, D)
    return torch.where(seq_lens[:, None, None] > 0, out, 0.0).to(q.dtype)


def _gather_plan(block_table, seq_lens, page: int):
    """(B * N,) cache slots of every row's N = max_pages * page positions (dead ones: the row's first
    slot) and the (B, 1, 1, N) additive mask (0 live, -inf dead; SDPA gives the bits of the bool mask).
    Made once per decode step: every layer passes the same block table and lengths (made per layer it
    was ~8 small ops each time, 5% of a tiny model's decode layer on the CPU)."""
    def make():
        pos = torch.arange(block_table.shape[1] * page, device=block_table.device)  # (N,)
        live = pos < seq_lens[:, None]  # (B, N)
        slot = block_table.long().repeat_interleave(page, dim=1) * page + pos % page  # (B, N) into (P * page)
        slot = torch.where(live, slot, slot[:, :1]).view(-1)
        mask = torch.zeros(live.shape, device=live.device).masked_fill_(~live, float("-inf"))[:, None, None, :]
        return slot, mask

    return remembered("paged decode plan", (block_table, seq_lens), (page, tuple(block_table.shape)), make)



# ---- decode: Triton ----

@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, len_ptr, part_ptr, lse_ptr, out_ptr, sem_ptr,
                   cos_ptr, sin_ptr, pos_ptr, slot_ptr, bias_ptr, rows_ptr, segs_ptr,
                   sq_b, sq_g, sq_h, sq_part, sk_p, sk_t, sk_h, sv_p, sv_t, sv_h, sbt, bt_w, s_cs, qk_scale,
                   G: tl.constexpr, HEAD_D: tl.constexpr, PAGE: tl.constexpr, ROPE: tl.constexpr,
                   QKV_PARTS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_N: tl.constexpr, F32_DOT: tl.constexpr):
    kvh, p = tl.program_id(0), tl.program_id(1)  # a segment's kv heads launch together
    b = tl.load(segs_ptr + p * 3)  # segment p: tiles [lo, hi) of row b (-1: no segment)
    if b >= 0:
        lo, hi = tl.load(segs_ptr + p * 3 + 1), tl.load(segs_ptr + p * 3 + 2)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        row_ok = (g < G)[:, None] & (d < HEAD_D)[None, :]  # (BG, BD)
        group = q_ptr + b.to(tl.int64) * sq_b + kvh * sq_g  # this kv head's query heads (then, with ROPE, k and v)
        n_keys = tl.load(len_ptr + b)
        info = rows_ptr + b * 4  # row b: first full segment, full segments, remainder segment, tiles
        bt_row = bt_ptr + b.to(tl.int64) * sbt
        start, page_end = lo * BLOCK_N, tl.minimum(hi * BLOCK_N, bt_w * PAGE)  # (a row without keys: one empty tile)
        page = _page_ids(bt_row, start + tl.arange(0, BLOCK_N), start + tl.arange(0, BLOCK_N) < page_end, PAGE)
        if ROPE:
            q = _rope_and_write(group, bias_ptr + kvh * sq_g, cos_ptr, sin_ptr, pos_ptr, slot_ptr, k_ptr, v_ptr, b,
                                kvh, hi == tl.load(info + 3), sq_h, sq_part, s_cs, sk_p, sk_t, sk_h, sv_p, sv_t, sv_h,
                                g, d, row_ok, G, HEAD_D, PAGE, QKV_PARTS, HAS_BIAS)
        else:
            q = tl.load(group + g[:, None] * sq_h + d[None, :], mask=row_ok, other=0.0)  # (BG, BD)
        m, l, acc = _decode_span(q, page, start, hi * BLOCK_N, n_keys, page_end, bt_row, k_ptr, v_ptr, kvh, sk_p,
                                 sk_t, sk_h, sv_p, sv_t, sv_h, qk_scale, PAGE, HEAD_D, BLOCK_G, BLOCK_D, BLOCK_N,
                                 F32_DOT)
        o = acc / tl.maximum(l, 1e-30)[:, None]  # 0 for a row without keys
        row = b.to(tl.int64) * (G * tl.num_programs(0)) + kvh * G + g  # (BG,) index into (B, Hq)
        first, n_full, rem = tl.load(info), tl.load(info + 1), tl.load(info + 2)
        readers = n_full + (rem >= 0).to(tl.int32)
        if readers == 1:  # the row is one segment
            tl.store(out_ptr + row[:, None] * HEAD_D + d[None, :], o.to(out_ptr.dtype.element_ty), mask=row_ok)
        else:
            part = _part_rows(kvh, p, G) + g  # (BG,)
            tl.store(part_ptr + part[:, None] * HEAD_D + d[None, :], o, mask=row_ok)
            tl.store(lse_ptr + part, tl.where(l > 0, m + tl.log2(tl.maximum(l, 1e-30)), float("-inf")), mask=g < G)
            tl.debug_barrier()  # every thread's part is written before the release below
            sem = sem_ptr + b.to(tl.int64) * tl.num_programs(0) + kvh
            if tl.atomic_add(sem, 1, sem="acq_rel") == readers - 1:  # the last of the row's segments to finish
                tl.store(sem, 0)  # zero again for the next call
                _merge_parts(part_ptr, lse_ptr, out_ptr, row, g, d, kvh, first, n_full, rem, readers, G, HEAD_D,
                             BLOCK_G, BLOCK_D)


@triton.jit
def _part_rows(kvh, p, G: tl.constexpr):
    """First of the G scratch rows (of (Hkv, S, G)) where segment p keeps its part of its row."""
    return (kvh * tl.num_programs(1) + p).to(tl.int64) * G


@triton.jit
def _rope_and_write(group, bias, cos_ptr, sin_ptr, pos_ptr, slot_ptr, k_ptr, v_ptr, b, kvh, writes,
                    sq_h, sq_part, s_cs, sk_p, sk_t, sk_h, sv_p, sv_t, sv_h, g, d, row_ok,
                    G: tl.constexpr, HEAD_D: tl.constexpr, PAGE: tl.constexpr, PARTS: tl.constexpr,
                    HAS_BIAS: tl.constexpr):
    """`rope_cache` of row b's group kvh: returns its RoPE'd queries (BG, BD); with ``writes`` (this
    program reads the row's last tile, which holds the last key) this step's key and value go into
    the cache first, and are read back with the tiles (the barrier orders the write before the
    program's own loads). The group's values come through `qkv_values` (split-K partials summed,
    bias added) at ``group`` and, for the bias, the same column offsets from ``bias``."""
    dt = k_ptr.dtype.element_ty
    c, s = rope_tables(cos_ptr, sin_ptr, tl.load(pos_ptr + b), s_cs, d, HEAD_D)
    heads = g[:, None] * sq_h
    q_in, q = rope_rows(group + heads, bias + heads, d[None, :], row_ok, c[None, :], s[None, :], sq_part, dt, HEAD_D,
                        PARTS, HAS_BIAS)
    if writes:
        ok = d < HEAD_D
        k_in, k = rope_rows(group + G * sq_h, bias + G * sq_h, d, ok, c, s, sq_part, dt, HEAD_D, PARTS, HAS_BIAS)
        v = qkv_values(group + (G + 1) * sq_h + d, bias + (G + 1) * sq_h + d, ok, sq_part, dt, PARTS, HAS_BIAS)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        page, off = slot // PAGE, slot % PAGE
        tl.store(k_ptr + page * sk_p + off * sk_t + kvh * sk_h + d, k, mask=ok)
        tl.store(v_ptr + page * sv_p + off * sv_t + kvh * sv_h + d, v, mask=ok)
    tl.debug_barrier()
    return q


@triton.jit
def _merge_parts(part_ptr, lse_ptr, out_ptr, row, g, d, kvh, first, n_full, rem, readers, G: tl.constexpr,
                 HEAD_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[row] = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M), M = max_s lse_s, over the row's
    segments (its full ones first..first + n_full - 1, then its remainder rem), summed in that order
    whatever order they finished in. Loads bypass L1 (other programs wrote the parts)."""
    live = g < G
    top = tl.full([BLOCK_G], float("-inf"), tl.float32)
    for k in range(0, readers):
        part = _part_rows(kvh, tl.where(k < n_full, first + k, rem), G) + g
        top = tl.maximum(top, tl.load(lse_ptr + part, mask=live, other=float("-inf"), cache_modifier=".cg"))
    top = tl.where(top == float("-inf"), 0.0, top)  # (BG,); a row with no keys anywhere: weights 0
    ok = live[:, None] & (d < HEAD_D)[None, :]
    num = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    den = tl.zeros([BLOCK_G], tl.float32)
    for k in range(0, readers):
        part = _part_rows(kvh, tl.where(k < n_full, first + k, rem), G) + g
        w = tl.exp2(tl.load(lse_ptr + part, mask=live, other=float("-inf"), cache_modifier=".cg") - top)
        o = tl.load(part_ptr + part[:, None] * HEAD_D + d[None, :], mask=ok, other=0.0, cache_modifier=".cg")
        num += w[:, None] * o
        den += w
    out = num / tl.maximum(den, 1e-30)[:, None]
    tl.store(out_ptr + row[:, None] * HEAD_D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)


def split_semaphores(n: int, device: torch.device) -> torch.Tensor:
    """n zeroed int32 arrival counters on ``device``, shared by every decode call there.

    A call's last program of each (row, kv head) read by several sets its counter back to 0, so
    they are zero between calls (calls on one device run one after another: one stream). Grown
    when too small, never freed: a captured CUDA graph keeps the address it saw. Never allocated
    during a capture: the eager warm-up before one allocates them.
    """
    key = (device.type, device.index)  # a tensor's CUDA device always has its index
    have = _SEMAPHORES.get(key)
    if have is None or have.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"paged decode: {n} split counters needed inside a CUDA-graph capture; "
                               "run the same call once eagerly before capturing it")
        _SEMAPHORES_KEPT.append(have)
        have = _SEMAPHORES[key] = torch.zeros(max(n, MIN_SEMAPHORES), dtype=torch.int32, device=device)
    return have


def launch_decode(q, k_cache, v_cache, block_table, seq_lens, scale: float, q_per_group: int,
                  max_seqlen_k: int | None, rope=None, plan: DecodePlan | None = None, programs: int | None = None):
    """The decode launch (module docstring). q: (B, Hq, D) queries, or with ``rope`` =
    (cos, sin, positions, slot_mapping, bias | None) the step's fused QKV rows (B, Hkv * (G + 2) * D)
    or their (S, B, Hkv * (G + 2) * D) fp32 split-K partials, RoPE'd and their K/V written in the
    kernel (`rope_paged_decode`). plan: the call's `decode_plan` (made here when None; a decode
    step makes one for its layers); programs: the plan's target when it is made here (tests). Returns
    (B, Hq, D) in the cache's dtype."""
    qkv_parts = q.shape[0] if q.dim() == 3 and rope is not None else 0
    B, (_, page, hkv, D) = q.shape[1 if qkv_parts else 0], k_cache.shape
    G, block_d = q_per_group, max(16, next_pow2(D))
    out = torch.empty(B, hkv * G, D, dtype=k_cache.dtype, device=q.device)
    if B == 0:
        return out
    if plan is None:
        plan = decode_plan(seq_lens, k_cache, max_seqlen_k or block_table.shape[1] * page, programs)
    launch = plan.launch
    part = torch.empty(hkv, launch.segments, G, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(hkv, launch.segments, G, dtype=torch.float32, device=q.device)
    sem = split_semaphores(B * hkv, q.device)
    if rope is None:  # q (B, Hq, D): group kvh's heads start at kvh * G (the RoPE pointers unused)
        strides, tables, s_cs = (q.stride(0), G * q.stride(1), q.stride(1), 0), (seq_lens,) * 5, 0
    else:  # qkv rows: per group G query heads, the key, the value
        *tables, bias = rope
        tables = (*tables, q if bias is None else bias)
        strides = (q.stride(-2), (G + 2) * D, D, q.stride(0) if qkv_parts else 0)
        s_cs = rope[0].stride(0)
    _decode_kernel[(hkv, launch.segments)](
        q, k_cache, v_cache, block_table, seq_lens.contiguous(), part, lse, out, sem, *tables, plan.rows,
        plan.segments, *strides, *k_cache.stride()[:3], *v_cache.stride()[:3], block_table.stride(0),
        block_table.shape[1], s_cs,
        float(scale) * LOG2E, G=G, HEAD_D=D, PAGE=page, ROPE=rope is not None, QKV_PARTS=qkv_parts,
        HAS_BIAS=rope is not None and rope[4] is not None, BLOCK_G=max(16, next_pow2(G)), BLOCK_D=block_d,
        BLOCK_N=launch.block_n, F32_DOT=f32_dot(k_cache.dtype), num_warps=launch.warps, num_stages=launch.stages)
    return out


def paged_decode_attention_triton(q, k_cache, v_cache, block_table, seq_lens, scale: float,
                                  max_seqlen_k: int | None = None, plan: DecodePlan | None = None,
                                  programs: int | None = None):
    """Triton decode (module docstring). max_seqlen_k (default: the table's width in keys) sizes the
    launch; plan and programs as in `launch_decode`."""
    q, k_cache, v_cache, block_table = unit_last_stride(q, k_cache, v_cache, block_table)
    return launch_decode(q, k_cache, v_cache, block_table, seq_lens, scale, q.shape[1] // k_cache.shape[2],
                         max_seqlen_k, plan=plan, programs=programs)


def paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale: float, backend: str = "auto",
                           max_seqlen_k: int | None = None, plan: DecodePlan | None = None):
    """Attention of one query token per row over its paged KV cache; spec in the module docstring.

    q: (B, Hq, D); k_cache, v_cache: (num_pages, page_size, Hkv, D), q's dtype, page_size a
    power of two; block_table: (B, max_pages) int32 page ids (every entry a valid page);
    seq_lens: (B,) int32 keys per row, 0 <= seq_lens <= max_pages * page_size. Returns
    (B, Hq, D) in q.dtype. backend "triton" is CUDA-graph capturable. max_seqlen_k: the
    longest row the caller ever passes; the Triton launch shape comes from it (and B) instead of
    the table's width, so a trimmed table and a padded one give bit-identical rows. plan: the
    Triton path's `decode_plan` of these seq_lens, when the caller made it already.
    """
    if q.dim() != 3:
        raise ValueError(f"paged_decode_attention: q must be (B, Hq, D), got {tuple(q.shape)}")
    check_paged(q, k_cache, v_cache, block_table, seq_lens, q.shape[0], "paged_decode_attention")
    impl = {"triton": paged_decode_attention_triton, "torch": paged_decode_attention_torch,
            "ref": paged_decode_attention_ref}[choose(backend, q, k_cache, v_cache, block_table, seq_lens)]
    if impl is paged_decode_attention_triton:
        return impl(q, k_cache, v_cache, block_table, seq_lens, scale, max_seqlen_k=max_seqlen_k, plan=plan)
    return impl(q, k_cache, v_cache, block_table, seq_lens, scale)


# ---- decode with RoPE and the step's K/V write folded in ----

def qkv_rows_ref(qkv, bias, dtype):
    """Fused QKV rows (B, W) from the kernel's inputs: rows or (S, B, W) fp32 split-K partials
    (summed in order, rounded to dtype), then + bias (rounded again, as megatron's linear)."""
    rows = sum_parts_ref(qkv, dtype) if qkv.dim() == 3 else qkv
    return rows if bias is None else rows + bias


def rope_paged_decode_ref(qkv, cos, sin, positions, slot_mapping, k_cache, v_cache, block_table, seq_lens,
                          scale: float, q_per_group: int, max_seqlen_k: int | None = None, backend: str = "ref",
                          bias=None):
    """The spec: `qkv_rows_ref`, `rope_cache`'s, then `paged_decode_attention` of its queries
    (``backend`` "ref" or "torch")."""
    qkv = qkv_rows_ref(qkv, bias, k_cache.dtype)
    q = rope_cache_ref(qkv, cos, sin, positions, slot_mapping, k_cache, v_cache, k_cache.shape[2], q_per_group)
    return paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale, backend=backend,
                                  max_seqlen_k=max_seqlen_k)


def rope_paged_decode(qkv, cos, sin, positions, slot_mapping, k_cache, v_cache, block_table, seq_lens,
                      scale: float, q_per_group: int, max_seqlen_k: int | None = None, backend: str = "auto",
                      bias=None, plan: DecodePlan | None = None, programs: int | None = None):
    """One decode step's RoPE, K/V cache write and attention (module docstring).

    qkv (B, Hkv * (G + 2) * D) fused QKV rows with dense rows, or (S, B, Hkv * (G + 2) * D) fp32
    split-K partials of them (`megarl.rollout.split_linear`); bias (Hkv * (G + 2) * D,) or None,
    added to the rows (`qkv_rows_ref`); cos, sin (S_max, D); positions, slot_mapping (B,) as in
    `rope_cache`; the caches, block_table, seq_lens (counting this step's key) and max_seqlen_k as
    in `paged_decode_attention`; plan and programs as in `launch_decode`. Writes the step's K/V into the cache;
    returns (B, Hkv * G, D) in the cache's dtype.
    """
    _, _, hkv, d = k_cache.shape
    width = hkv * (q_per_group + 2) * d
    if qkv.dim() not in (2, 3) or qkv.shape[-1] != width or (qkv.dim() == 3 and qkv.dtype != torch.float32):
        raise ValueError(f"rope_paged_decode: qkv must be (B, Hkv * (G + 2) * D) = (B, {width}) rows or (S, B, {width})"
                         f" fp32 partials, got {tuple(qkv.shape)} {qkv.dtype}")
    if bias is not None and tuple(bias.shape) != (width,):
        raise ValueError(f"rope_paged_decode: bias must be ({width},), got {tuple(bias.shape)}")
    check_rope_inputs(qkv, k_cache, v_cache, "rope_paged_decode")
    b = qkv.shape[-2]  # the row checks see partials as rows of the cache's dtype (a meta tensor: no launch)
    rows = qkv if qkv.dim() == 2 else torch.empty(qkv.shape[1:], dtype=k_cache.dtype, device="meta")
    check_paged(rows.view(b, -1, d), k_cache, v_cache, block_table, seq_lens, b, "rope_paged_decode")
    impl = choose(backend, qkv, cos, k_cache, block_table, seq_lens)
    if impl != "triton":
        return rope_paged_decode_ref(qkv, cos, sin, positions, slot_mapping, k_cache, v_cache, block_table, seq_lens,
                                     scale, q_per_group, max_seqlen_k, backend=impl, bias=bias)
    block_table, = unit_last_stride(block_table)
    return launch_decode(qkv, k_cache, v_cache, block_table, seq_lens, scale, q_per_group, max_seqlen_k,
                         rope=(cos, sin, positions, slot_mapping, bias), plan=plan, programs=programs)
