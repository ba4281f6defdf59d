"""Paged KV-cache attention, prefill / extend: a packed chunk of new queries per sequence.

Spec (`paged_prefill_attention_ref`). q (T, Hq, D) packs N sequences: sequence i's queries are
q[cu_seqlens_q[i]:cu_seqlens_q[i+1]] (q_len_i of them); its keys 0 .. seq_lens[i] - 1 (this
chunk's included, already written) live in the paged cache as in `paged_decode.py`. Its queries
sit at positions ctx_i + t, ctx_i = seq_lens[i] - q_len_i, t = 0 .. q_len_i - 1, and are causal:
    out[cu_i + t, h] = softmax(scale * K q) V       over keys 0 .. ctx_i + t
(bottom-right-aligned causal mask), GQA as in decode, softmax in fp32, out in q.dtype.
Rows before cu_seqlens_q[0] (a mixed step's decode rows, attended elsewhere) and past
cu_seqlens_q[N] (a CUDA graph's padding) belong to no sequence: zeros in the reference and torch
versions, left unwritten by the kernel; so do the rows of a sequence with no queries.

Kernel (flash attention over pages, GQA-aware). Grid (query blocks, N, Hkv). A program takes
TOK = BLOCK_R // G consecutive queries of sequence i and all G query heads of kv head kvh as
one (BLOCK_R, D) tile, row r = (query r // G, head r % G) (those G heads are adjacent in q),
so each K/V tile is loaded once per kv head. It walks keys 0 .. ctx_i + (its last query) in
BLOCK_N tiles through the page table with `paged_decode._attend_span` (fp32 online softmax):
first the tiles every row sees whole, unmasked, then the diagonal ones with key <= position
per row. Query blocks past q_len_i exit at once, so the grid needs only a bound on q_len
(`max_seqlen_q`; computed with one host sync when not given).
"""
import torch

from megarl_kernels.dispatch import choose, next_pow2, tl, triton
from megarl_kernels.decode_plan import fit_keys
from megarl_kernels.paged_decode import (LOG2E, _attend_span, check_paged, f32_dot, sdpa_fp32, sequence_keys,
                                         unit_last_stride)

# (query x head) rows and keys per program step. Chosen by `benchmarks/bench_attention.py`'s sweep
# on the Qwen2.5-1.5B layer (Hq 12, Hkv 2, D 128, bf16, page 16), prefills of 16 x 128 and
# 16 x 1024 tokens: the setting near the top of three sweeps, whose run-to-run spread was ~10%
# (table in docs/performance.md). Any shape is correct; wider heads shrink BLOCK_N to fit shared
# memory (`fit_keys`). Two loops (unmasked tiles, then the causal diagonal) beat one masked loop
# on long prompts.
BLOCK_R = 128
BLOCK_N = 32
NUM_WARPS = 4
NUM_STAGES = 2


def _spans(cu_seqlens_q, seq_lens):
    """Per sequence (q0, q1, n_keys) as Python ints (one host sync)."""
    cu, n = cu_seqlens_q.tolist(), seq_lens.tolist()
    return [(cu[i], cu[i + 1], n[i]) for i in range(len(n))]


def paged_prefill_attention_ref(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale: float,
                                max_seqlen_q=None):
    """The spec: loops over sequences, queries and heads in fp32. Returns (T, Hq, D) in q.dtype."""
    T, Hq, D = q.shape
    G = Hq // k_cache.shape[2]
    out = torch.zeros(T, Hq, D, dtype=torch.float32, device=q.device)
    for i, (q0, q1, n) in enumerate(_spans(cu_seqlens_q, seq_lens)):
        k = sequence_keys(k_cache, block_table[i], n).float()  # (n, Hkv, D)
        v = sequence_keys(v_cache, block_table[i], n).float()
        for t in range(q1 - q0):
            seen = n - (q1 - q0) + t + 1  # keys 0 .. position
            for h in range(Hq):
                w = torch.softmax(k[:seen, h // G] @ q[q0 + t, h].float() * scale, dim=0)  # (seen,)
                out[q0 + t, h] = w @ v[:seen, h // G]
    return out.to(q.dtype)


def paged_prefill_attention_torch(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale: float,
                                  max_seqlen_q=None):
    """Vectorized: every sequence's queries padded to (N, M), its pages gathered, one masked SDPA."""
    N, hkv = block_table.shape[0], k_cache.shape[2]
    lead = int(cu_seqlens_q[0])  # rows before the first sequence's (a mixed step's decode rows)
    if lead:
        out = paged_prefill_attention_torch(q[lead:], k_cache, v_cache, block_table, cu_seqlens_q - lead,
                                            seq_lens, scale, max_seqlen_q)
        return torch.cat([out.new_zeros(lead, *q.shape[1:]), out])
    padded_rows = q.shape[0] - int(cu_seqlens_q[-1])  # rows past the last sequence (a graph's padding)
    if padded_rows:
        out = paged_prefill_attention_torch(q[:-padded_rows], k_cache, v_cache, block_table, cu_seqlens_q,
                                            seq_lens, scale, max_seqlen_q)
        return torch.cat([out, out.new_zeros(padded_rows, *q.shape[1:])])
    T, Hq, D = q.shape
    if T == 0:
        return torch.empty_like(q)
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]  # (N,)
    if bool((q_lens == 0).any()):  # sequences without queries (a mixed step's decode rows): not gathered
        keep = q_lens > 0
        return paged_prefill_attention_torch(q, k_cache, v_cache, block_table[keep],
                                             torch.cat([cu_seqlens_q[:1], cu_seqlens_q[1:][keep]]), seq_lens[keep],
                                             scale, max_seqlen_q)
    M = int(max_seqlen_q) if max_seqlen_q is not None else int(q_lens.max())
    row = torch.repeat_interleave(torch.arange(N, device=q.device), q_lens, output_size=T)  # (T,)
    col = torch.arange(T, device=q.device) - cu_seqlens_q[row].long()  # query index within its sequence
    padded = q.new_zeros(N, M, Hq, D)
    padded[row, col] = q
    idx = block_table.reshape(-1).long()
    k = k_cache.index_select(0, idx).view(N, -1, hkv, D)  # (N, K = max_pages * page, Hkv, D)
    v = v_cache.index_select(0, idx).view(N, -1, hkv, D)
    keys = torch.arange(k.shape[1], device=q.device)  # (K,)
    pos = (seq_lens - q_lens)[:, None] + torch.arange(M, device=q.device)  # (N, M) query positions
    visible = (keys[None, None, :] <= pos[:, :, None]) & (keys < seq_lens[:, None])[:, None, :]  # (N, M, K)
    live = (keys < seq_lens[:, None])[:, :, None, None]
    k, v = k.masked_fill(~live, 0.0), v.masked_fill(~live, 0.0)  # dead slots may hold NaN
    out = sdpa_fp32(padded.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), visible[:, None], scale)
    return out.transpose(1, 2)[row, col].to(q.dtype)  # (T, Hq, D)


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, cu_ptr, len_ptr,
                    sq_t, sq_h, sk_p, sk_t, sk_h, sv_p, sv_t, sv_h, sbt, qk_scale,
                    G: tl.constexpr, HEAD_D: tl.constexpr, PAGE: tl.constexpr, TOK: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, F32_DOT: tl.constexpr):
    blk, i, kvh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q0 = tl.load(cu_ptr + i)
    q_len = tl.load(cu_ptr + i + 1) - q0
    t_first = blk * TOK
    if t_first < q_len:
        ctx = tl.load(len_ptr + i) - q_len
        r = tl.arange(0, BLOCK_R)
        d = tl.arange(0, BLOCK_D)
        t = t_first + r // G  # (BR,) query index within the sequence
        h = kvh * G + r % G  # (BR,) query head
        ok = ((r < TOK * G) & (t < q_len))[:, None] & (d < HEAD_D)[None, :]  # (BR, BD)
        rows = (q0 + t).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * sq_t + h[:, None] * sq_h + d[None, :], mask=ok, other=0.0)
        pos = ctx + t  # (BR,) key position of each query
        end = ctx + tl.minimum(t_first + TOK, q_len)  # keys 0 .. end - 1 are seen by some row
        bt_row = bt_ptr + i.to(tl.int64) * sbt
        m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        full = (ctx + t_first + 1) // BLOCK_N * BLOCK_N  # keys 0 .. full - 1: seen by every row
        m, l, acc = _attend_span(q, m, l, acc, pos, 0, full, BLOCK_N, bt_row, k_ptr, v_ptr, kvh, sk_p, sk_t, sk_h,
                                 sv_p, sv_t, sv_h, qk_scale, False, PAGE, HEAD_D, BLOCK_D, BLOCK_N, F32_DOT)
        m, l, acc = _attend_span(q, m, l, acc, pos, full, end, BLOCK_N, bt_row, k_ptr, v_ptr, kvh, sk_p, sk_t, sk_h,
                                 sv_p, sv_t, sv_h, qk_scale, True, PAGE, HEAD_D, BLOCK_D, BLOCK_N, F32_DOT)
        o = acc / tl.maximum(l, 1e-30)[:, None]
        hq = G * tl.num_programs(2)
        tl.store(out_ptr + (rows * hq + h)[:, None] * HEAD_D + d[None, :], o.to(out_ptr.dtype.element_ty), mask=ok)


def paged_prefill_attention_triton(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale: float,
                                   max_seqlen_q=None):
    """Triton flash attention over pages (module docstring); no host sync when max_seqlen_q is given."""
    T, Hq, D = q.shape
    _, page, hkv, _ = k_cache.shape
    N = seq_lens.shape[0]
    out = torch.empty(T, Hq, D, dtype=q.dtype, device=q.device)
    if T == 0 or N == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())  # host sync
    q, k_cache, v_cache, block_table = unit_last_stride(q, k_cache, v_cache, block_table)
    G, block_d = Hq // hkv, max(16, next_pow2(D))
    block_r = max(BLOCK_R if block_d <= 128 else BLOCK_R // 2, next_pow2(G))  # (rows, D) fp32 acc in registers
    tok = block_r // G
    _prefill_kernel[(triton.cdiv(max(max_seqlen_q, 1), tok), N, hkv)](
        q, k_cache, v_cache, out, block_table, cu_seqlens_q.contiguous(), seq_lens.contiguous(),
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], block_table.stride(0),
        float(scale) * LOG2E, G=G, HEAD_D=D, PAGE=page, TOK=tok, BLOCK_R=block_r,
        BLOCK_D=block_d, BLOCK_N=fit_keys(BLOCK_N, block_d, q.element_size(), NUM_STAGES), F32_DOT=f32_dot(q.dtype),
        num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out


def paged_prefill_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale: float,
                            max_seqlen_q: int | None = None, backend: str = "auto"):
    """Causal attention of packed query chunks over their paged KV cache; spec in the module docstring.

    q: (T, Hq, D) packed; k_cache, v_cache: (num_pages, page_size, Hkv, D) as in
    `paged_decode_attention`; block_table: (N, max_pages) int32; cu_seqlens_q: (N+1,) int32,
    non-decreasing, cu_seqlens_q[N] <= T (rows outside it: no sequence's); seq_lens: (N,) int32 keys per sequence including
    this chunk, seq_lens[i] >= q_len_i. max_seqlen_q: a Python int >= every q_len_i (the Triton
    grid; without it one host sync). Returns (T, Hq, D) in q.dtype.
    """
    if q.dim() != 3 or cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(f"paged_prefill_attention: want q (T, Hq, D), cu_seqlens_q (N+1,), seq_lens (N,); got "
                         f"{tuple(q.shape)}, {tuple(cu_seqlens_q.shape)}, {tuple(seq_lens.shape)}")
    check_paged(q, k_cache, v_cache, block_table, seq_lens, seq_lens.shape[0], "paged_prefill_attention")
    impl = {"triton": paged_prefill_attention_triton, "torch": paged_prefill_attention_torch,
            "ref": paged_prefill_attention_ref}[choose(backend, q, k_cache, v_cache, block_table, seq_lens)]
    return impl(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale, max_seqlen_q)
