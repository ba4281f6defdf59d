"""Weight layout conversions between Megatron and Hugging Face.

Spec (the `*_ref` functions, torch view/split/cat):
  * Megatron's fused `linear_qkv` is interleaved per query group: with H heads,
    G query groups, h = H / G and head dim d, its rows are
        [for g in range(G): q rows of heads g*h .. g*h+h-1 (h*d), k of group g (d), v of group g (d)]
    shape ((H + 2G) d, hidden) (or ((H + 2G) d,) for the bias). HF keeps
    q_proj (H d, hidden), k_proj (G d, hidden), v_proj (G d, hidden).
  * Megatron's SwiGLU `linear_fc1` is [gate; up] per TP shard, so the TP
    concatenation is [gate_0; up_0; gate_1; up_1; ...] (tp groups of 2 segments).
Both are "row groups": x has n_groups * sum(seg_rows) rows, each group made
of segments of seg_rows[i] rows that belong to output i. `split_interleaved`
and `merge_interleaved` convert in one pass over memory (Triton: each fused
row is read once and written once, with one masked store per output).

Vocab padding and TP split/concat are single torch copies or views, already
one pass at copy bandwidth, so they have no Triton kernel.
"""
import torch

from megarl_kernels.dispatch import choose, next_pow2, tl, triton

# Tile of fused rows x columns per program: 8 x 1024 bf16 = 16 KiB moved, 16
# per thread at 4 warps (two 16 B accesses). Unswept.
BLOCK_R, BLOCK_C = 8, 1024


def split_interleaved_ref(x, n_groups: int, seg_rows):
    """(n_groups * sum(seg_rows), *rest) -> [ (n_groups * seg_rows[i], *rest) ]."""
    rest = x.shape[1:]
    parts = x.reshape(n_groups, sum(seg_rows), *rest).split(list(seg_rows), dim=1)
    return [p.reshape(n_groups * r, *rest) for p, r in zip(parts, seg_rows)]


def merge_interleaved_ref(parts, n_groups: int):
    """Inverse of split_interleaved_ref."""
    rest = parts[0].shape[1:]
    grouped = [p.reshape(n_groups, p.shape[0] // n_groups, *rest) for p in parts]
    return torch.cat(grouped, dim=1).reshape(-1, *rest)


@triton.jit
def _rows(pid_r, pid_c, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # (BR,) fused rows, (BC,) columns, (BR, BC) in-bounds mask
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)  # (BR,)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)  # (BC,)
    ok = (r < R)[:, None] & (c < C)[None, :]
    return r, c, ok


@triton.jit
def _split_kernel(x_ptr, o0_ptr, o1_ptr, o2_ptr, R, C, S0, S1, S2,
                  BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r, c, ok = _rows(tl.program_id(0), tl.program_id(1), R, C, BLOCK_R, BLOCK_C)
    g, w = r // (S0 + S1 + S2), r % (S0 + S1 + S2)
    col = c[None, :].to(tl.int64)
    x = tl.load(x_ptr + r.to(tl.int64)[:, None] * C + col, mask=ok)
    in0, in1, in2 = w < S0, (w >= S0) & (w < S0 + S1), w >= S0 + S1
    tl.store(o0_ptr + (g * S0 + w).to(tl.int64)[:, None] * C + col, x, mask=ok & in0[:, None])
    tl.store(o1_ptr + (g * S1 + w - S0).to(tl.int64)[:, None] * C + col, x, mask=ok & in1[:, None])
    tl.store(o2_ptr + (g * S2 + w - S0 - S1).to(tl.int64)[:, None] * C + col, x, mask=ok & in2[:, None])


@triton.jit
def _merge_kernel(x_ptr, i0_ptr, i1_ptr, i2_ptr, R, C, S0, S1, S2,
                  BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r, c, ok = _rows(tl.program_id(0), tl.program_id(1), R, C, BLOCK_R, BLOCK_C)
    g, w = r // (S0 + S1 + S2), r % (S0 + S1 + S2)
    col = c[None, :].to(tl.int64)
    in0, in1, in2 = w < S0, (w >= S0) & (w < S0 + S1), w >= S0 + S1
    x0 = tl.load(i0_ptr + (g * S0 + w).to(tl.int64)[:, None] * C + col, mask=ok & in0[:, None])
    x1 = tl.load(i1_ptr + (g * S1 + w - S0).to(tl.int64)[:, None] * C + col, mask=ok & in1[:, None])
    x2 = tl.load(i2_ptr + (g * S2 + w - S0 - S1).to(tl.int64)[:, None] * C + col, mask=ok & in2[:, None])
    x = tl.where(in0[:, None], x0, tl.where(in1[:, None], x1, x2))
    tl.store(x_ptr + r.to(tl.int64)[:, None] * C + col, x, mask=ok)


def _launch(kernel, fused, parts, seg_rows):
    R = fused.shape[0]
    C = fused[0].numel() if R else 0
    if R == 0 or C == 0:
        return
    s = list(seg_rows) + [0] * (3 - len(seg_rows))
    p = list(parts) + [parts[0]] * (3 - len(parts))  # unused slots: any valid pointer
    block_c = min(BLOCK_C, next_pow2(C))
    grid = (triton.cdiv(R, BLOCK_R), triton.cdiv(C, block_c))
    kernel[grid](fused, *p, R, C, *s, BLOCK_R=BLOCK_R, BLOCK_C=block_c, num_warps=4)


def _check(n_rows: int, n_groups: int, seg_rows, what: str):
    if not 1 <= len(seg_rows) <= 3 or n_rows != n_groups * sum(seg_rows):
        raise ValueError(f"{what}: {n_rows} rows is not {n_groups} groups x {list(seg_rows)} rows (1-3 segments)")


def split_interleaved(x, n_groups: int, seg_rows, backend: str = "auto"):
    """Row-group de-interleave, see the module docstring. Outputs are new contiguous tensors."""
    _check(x.shape[0], n_groups, seg_rows, "split_interleaved")
    impl = choose(backend, x)
    if impl != "triton":
        return [p.contiguous() for p in split_interleaved_ref(x, n_groups, seg_rows)]
    x = x.contiguous()
    outs = [x.new_empty(n_groups * r, *x.shape[1:]) for r in seg_rows]
    _launch(_split_kernel, x, outs, seg_rows)
    return outs


def merge_interleaved(parts, n_groups: int, backend: str = "auto"):
    """Inverse of split_interleaved: [ (n_groups * rows_i, *rest) ] -> fused."""
    seg_rows = [p.shape[0] // n_groups for p in parts]
    _check(sum(p.shape[0] for p in parts), n_groups, seg_rows, "merge_interleaved")
    impl = choose(backend, *parts)
    if impl != "triton":
        return merge_interleaved_ref(parts, n_groups)
    parts = [p.contiguous() for p in parts]
    fused = parts[0].new_empty(n_groups * sum(seg_rows), *parts[0].shape[1:])
    _launch(_merge_kernel, fused, parts, seg_rows)
    return fused


def _qkv_segments(rows: int, num_heads: int, num_query_groups: int):
    if num_heads % num_query_groups or rows % (num_heads + 2 * num_query_groups):
        raise ValueError(f"qkv: {rows} rows, {num_heads} heads, {num_query_groups} groups do not fit "
                         "((H + 2G) * head_dim rows with G dividing H)")
    d = rows // (num_heads + 2 * num_query_groups)
    return [num_heads // num_query_groups * d, d, d]


def qkv_split(qkv, num_heads: int, num_query_groups: int, backend: str = "auto"):
    """Megatron linear_qkv weight ((H+2G) d, hidden) or bias ((H+2G) d,) -> HF (q, k, v).

    Per TP shard pass that shard's head and group counts (H/tp, G/tp)."""
    seg = _qkv_segments(qkv.shape[0], num_heads, num_query_groups)
    return tuple(split_interleaved(qkv, num_query_groups, seg, backend))


def qkv_merge(q, k, v, num_query_groups: int, backend: str = "auto"):
    """HF (q (H d, ...), k (G d, ...), v (G d, ...)) -> Megatron linear_qkv ((H+2G) d, ...)."""
    return merge_interleaved([q, k, v], num_query_groups, backend)


def qkv_split_ref(qkv, num_heads: int, num_query_groups: int):
    return tuple(split_interleaved_ref(qkv, num_query_groups, _qkv_segments(qkv.shape[0], num_heads,
                                                                            num_query_groups)))


def qkv_merge_ref(q, k, v, num_query_groups: int):
    return merge_interleaved_ref([q, k, v], num_query_groups)


def fc1_split(fc1, tp_size: int = 1, backend: str = "auto"):
    """Megatron SwiGLU linear_fc1, concatenated over tp_size shards of [gate_r; up_r] -> (gate, up)."""
    half = fc1.shape[0] // (2 * tp_size)
    return tuple(split_interleaved(fc1, tp_size, [half, half], backend))


def fc1_merge(gate, up, tp_size: int = 1, backend: str = "auto"):
    """HF (gate_proj, up_proj) -> Megatron linear_fc1 as tp_size shards of [gate_r; up_r], concatenated."""
    return merge_interleaved([gate, up], tp_size, backend)


def fc1_split_ref(fc1, tp_size: int = 1):
    half = fc1.shape[0] // (2 * tp_size)
    return tuple(split_interleaved_ref(fc1, tp_size, [half, half]))


def fc1_merge_ref(gate, up, tp_size: int = 1):
    return merge_interleaved_ref([gate, up], tp_size)


def padded_vocab_size(vocab: int, divisible_by: int = 128, tp_size: int = 1) -> int:
    """Megatron's padded vocab: round up to a multiple of divisible_by * tp_size."""
    multiple = divisible_by * tp_size
    return -(-vocab // multiple) * multiple


def pad_vocab(weight, padded_vocab: int):
    """(V, ...) -> (padded_vocab, ...) with zero rows appended (one copy)."""
    if padded_vocab < weight.shape[0]:
        raise ValueError(f"pad_vocab: padded_vocab {padded_vocab} < vocab {weight.shape[0]}")
    out = weight.new_empty(padded_vocab, *weight.shape[1:])
    out[: weight.shape[0]].copy_(weight)
    out[weight.shape[0]:].zero_()
    return out


def unpad_vocab(weight, vocab: int):
    """(padded_vocab, ...) -> (vocab, ...): a view of the first vocab rows (no copy)."""
    return weight[:vocab]


def tp_split(x, tp_size: int, dim: int):
    """Full tensor -> tp_size equal shards along dim (views, no copy)."""
    if x.shape[dim] % tp_size:
        raise ValueError(f"tp_split: size {x.shape[dim]} of dim {dim} not divisible by tp_size {tp_size}")
    return list(x.chunk(tp_size, dim=dim))


def tp_concat(shards, dim: int):
    """TP shards -> full tensor along dim (one copy)."""
    return torch.cat(list(shards), dim=dim)
