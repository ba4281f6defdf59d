"""megarl_kernels.paged_attention: Triton and torch backends against the per-row spec.

Every cache is filled with NaN and only live keys (position < seq_len of some row) are
written, so a read of page 0, of an unused page, of a ragged last page's tail or of a
garbage table entry past a row's pages turns the output into NaN. Outputs are poisoned too:
every `torch.empty*` during the call returns NaN, so an unwritten row fails. Shapes: prime
seq lens, pages shuffled over the cache, GQA groups 1, 2, 6, page sizes 8 and 16, D 64 on
CPU (and 40, a non-power of two), 128 on GPU; a decode row with 0 keys; 1 to 40 decode programs,
so rows are cut and merged in many ways. On CPU the Triton path runs in the interpreter
(env var set before the import). Not covered on CPU: compiled-kernel numerics (tf32, bf16
tl.dot) and CUDA-graph capture; the `gpu` tests do those.
"""
import contextlib
import math

import torch

from kernel_backends import BACKENDS, DEVICE, needs_triton  # noqa: E402  (sets TRITON_INTERPRET first)

import pytest  # noqa: E402

from megarl_kernels.decode_plan import decode_launch, decode_plan, decode_plan_ref  # noqa: E402
from megarl_kernels.paged_attention import (  # noqa: E402
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
    paged_prefill_attention,
    paged_prefill_attention_ref,
)

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}
GROUPS = [(2, 2), (4, 2), (6, 1)]  # (Hq, Hkv): G = 1, 2, 6


@contextlib.contextmanager
def poisoned_empty():
    """Every torch.empty / empty_like / new_empty in the block returns NaN-filled (floats) memory."""
    saved = torch.empty, torch.empty_like, torch.Tensor.new_empty

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = lambda *a, **k: poison(saved[0](*a, **k))
    torch.empty_like = lambda *a, **k: poison(saved[1](*a, **k))
    torch.Tensor.new_empty = lambda self, *a, **k: poison(saved[2](self, *a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like, torch.Tensor.new_empty = saved


def paged(lens, page, hkv, d, dtype, seed=0, spare_pages=3):
    """A NaN cache holding random K/V for rows of `lens` keys on shuffled pages (never page 0).

    Returns k_cache, v_cache (P, page, Hkv, D), block_table (rows, max_pages + 2) int32 whose
    entries past a row's pages are random page ids (0 included), seq_lens (rows,) int32.
    """
    g = torch.Generator().manual_seed(seed)
    n_pages = [math.ceil(n / page) for n in lens]
    total = 1 + sum(n_pages) + spare_pages
    kc = torch.full((total, page, hkv, d), float("nan"))
    vc = torch.full((total, page, hkv, d), float("nan"))
    ids = (torch.randperm(total - 1, generator=g) + 1).tolist()
    width = max(n_pages, default=0) + 2
    table = torch.randint(0, total, (len(lens), width), generator=g)
    for i, n in enumerate(lens):
        mine, ids = ids[:n_pages[i]], ids[n_pages[i]:]
        table[i, :len(mine)] = torch.tensor(mine, dtype=torch.long)
        pos = torch.arange(n)
        kc[table[i, pos // page], pos % page] = torch.randn(n, hkv, d, generator=g)
        vc[table[i, pos // page], pos % page] = torch.randn(n, hkv, d, generator=g)
    return (kc.to(dtype).to(DEVICE), vc.to(dtype).to(DEVICE), table.int().to(DEVICE),
            torch.tensor(lens, dtype=torch.int32, device=DEVICE))


def queries(shape, dtype, seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def packed(q_lens):
    return torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)


def check(got, want, dtype):
    assert got.dtype == dtype and got.shape == want.shape
    assert not got.isnan().any(), "NaN in output: an unwritten row or a read of a dead cache slot"
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), **TOL[dtype])


def test_ref_by_hand():
    """q = (1, 0), keys (0, 0) and (ln 3, 0), scale 1: weights 1/4, 3/4; values (4, 0), (0, 8) -> (1, 6).

    Decode of that row, a 0-key row (-> 0), and the prefill of both keys (row 0 sees only key 0).
    """
    kc = torch.tensor([[[[0.0, 0.0]], [[math.log(3), 0.0]]]])  # (1 page, 2 slots, 1 head, 2)
    vc = torch.tensor([[[[4.0, 0.0]], [[0.0, 8.0]]]])
    q = torch.tensor([[[1.0, 0.0]], [[1.0, 0.0]]])  # (2, 1, 2)
    table = torch.zeros(2, 1, dtype=torch.int32)
    out = paged_decode_attention_ref(q, kc, vc, table, torch.tensor([2, 0], dtype=torch.int32), 1.0)
    torch.testing.assert_close(out, torch.tensor([[[1.0, 6.0]], [[0.0, 0.0]]]))
    pre = paged_prefill_attention_ref(q, kc, vc, table[:1], packed([2]), torch.tensor([2], dtype=torch.int32), 1.0)
    torch.testing.assert_close(pre, torch.tensor([[[4.0, 0.0]], [[1.0, 6.0]]]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page", [8, 16])
@pytest.mark.parametrize("hq,hkv", GROUPS)
def test_decode_matches_ref(backend, dtype, page, hq, hkv):
    lens = [0, 1, 7, 16, 29, 53]  # empty row, one key, full and ragged last pages
    kc, vc, table, sl = paged(lens, page, hkv, 64, dtype)
    q = queries((len(lens), hq, 64), dtype)
    want = paged_decode_attention_ref(q, kc, vc, table, sl, 0.125)
    with poisoned_empty():
        got = paged_decode_attention(q, kc, vc, table, sl, 0.125, backend=backend)
    check(got, want, dtype)
    assert (got[0] == 0).all()


def test_decode_torch_plan_follows_the_table():
    """The torch backend keeps the last (block table, lengths) gather plan: every layer of a step passes the
    same two tensors. An in-place change to either (the next step's), or new tensors, must not reuse it."""
    from megarl_kernels.paged_decode import paged_decode_attention_torch

    kc, vc, table, sl = paged([5, 20, 33], 8, 2, 16, torch.float32)
    q = queries((3, 4, 16), torch.float32)
    for _ in range(2):  # two "layers": the second call reuses the plan
        check(paged_decode_attention_torch(q, kc, vc, table, sl, 0.25),
              paged_decode_attention_ref(q, kc, vc, table, sl, 0.25), torch.float32)
    sl -= torch.tensor([1, 4, 2], dtype=torch.int32, device=sl.device)  # in place: the next step's lengths
    table[1, :2] = table[1, :2].flip(0)  # in place: pages of row 1 swapped
    check(paged_decode_attention_torch(q, kc, vc, table, sl, 0.25),
          paged_decode_attention_ref(q, kc, vc, table, sl, 0.25), torch.float32)
    short = sl.clone()
    short[2] = 9  # a new lengths tensor
    check(paged_decode_attention_torch(q, kc, vc, table, short, 0.25),
          paged_decode_attention_ref(q, kc, vc, table, short, 0.25), torch.float32)


@needs_triton
@pytest.mark.parametrize("programs", [1, 2, 3, 7, 40])
def test_decode_rows_over_programs(programs):
    """Rows cut into segments for a target of 1 to 40 programs (15 64-key tiles, a 0-key row counting
    one): 1 keeps every row whole; 2, 3 and 7 cut the long rows into full segments and remainders
    merged from two to four parts; 40 leaves most of the B + 40 programs without a segment. The plan
    equals its spec."""
    lens = [0, 3, 67, 131, 41, 90, 64, 65]
    kc, vc, table, sl = paged(lens, 16, 2, 64, torch.float32, seed=programs)
    q = queries((len(lens), 4, 64), torch.float32)
    plan = decode_plan(sl, kc, 256, programs)
    want_rows, want_segments = decode_plan_ref(sl, plan.launch.block_n, programs, plan.launch.segments)
    assert torch.equal(plan.rows, want_rows) and torch.equal(plan.segments, want_segments)
    with poisoned_empty():
        got = paged_decode_attention_triton(q, kc, vc, table, sl, 0.125, plan=plan)
    check(got, paged_decode_attention_ref(q, kc, vc, table, sl, 0.125), torch.float32)


def test_decode_plan_ref_by_hand():
    """Rows of 0, 3, 130 and 200 keys in 64-key tiles: 1, 1, 3, 4 tiles, T = 9. Target 3: c = 3, so
    row 2 is one full segment (0), row 3 a full one (1) and a remainder of one tile; rows 0, 1 and
    3's remainder are segments 2, 3, 4 (remainders in row order, after every full segment)."""
    rows, segments = decode_plan_ref(torch.tensor([0, 3, 130, 200]), 64, 3, 7)
    assert rows.tolist() == [[0, 0, 2, 1], [0, 0, 3, 1], [0, 1, -1, 3], [1, 1, 4, 4]]
    assert segments.tolist() == [[2, 0, 3], [3, 0, 3], [0, 0, 1], [1, 0, 1], [3, 3, 4], [-1, 0, 0], [-1, 0, 0]]


def test_decode_launch_from_shapes():
    """The target is per kv head: one program per row once B * Hkv fills the (stand-in) SMs, else enough
    programs to fill them, at most one per tile pair of the longest possible row; B + target segments."""
    cache = torch.empty(1, 16, 2, 128, dtype=torch.bfloat16, device=DEVICE)
    sms = 132 if torch.cuda.is_available() else 4
    assert decode_launch(4096, cache, 640).target == 4096 and decode_launch(4096, cache, 640).segments == 8192
    assert decode_launch(1, cache, 16).target == 1  # one tile: nothing to spread
    assert 1 < decode_launch(1, cache, 4096).target <= sms


@needs_triton
def test_decode_launch_on_a_shape_it_was_not_tuned_on():
    """The launch constants were tuned on 2 kv heads of 128 bf16 dims; on 4 kv heads of 256 fp32 dims the
    rules still give a sane launch (the K/V stages fit the shared-memory budget, one program a row once
    the rows fill the SMs, a bounded split below that) and the default launch gives the spec's output."""
    from megarl_kernels.decode_plan import MAX_SPLITS, NUM_STAGES, SMEM_BUDGET, sm_count

    cache = torch.empty(1, 16, 4, 256, dtype=torch.float32, device=DEVICE)
    sms = sm_count(cache.device)
    for batch in (1, 3, sms, 4 * sms):
        launch = decode_launch(batch, cache, 1000)
        assert 2 * NUM_STAGES * launch.block_n * 256 * 4 <= SMEM_BUDGET and launch.block_n >= 16
        assert launch.segments == batch + launch.target
        if batch * 4 >= sms:
            assert launch.target == batch
        else:
            assert batch <= launch.target <= batch * MAX_SPLITS
    kc, vc, table, sl = paged([1, 40, 77], 16, 4, 256, torch.float32, seed=3)
    q = queries((3, 8, 256), torch.float32)
    check(paged_decode_attention(q, kc, vc, table, sl, 0.0625, backend="triton"),
          paged_decode_attention_ref(q, kc, vc, table, sl, 0.0625), torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_strided_q_and_all_empty(backend):
    """q a (B, Hq, D) view into a fused qkv buffer; then every row with 0 keys -> all zeros."""
    kc, vc, table, sl = paged([13, 5, 37], 8, 2, 64, torch.float32)
    qkv = queries((3, 8 + 2 * 2, 64), torch.float32)
    q = qkv[:, :8]  # (3, 8, 64), stride(0) = 12 * 64
    check(paged_decode_attention(q, kc, vc, table, sl, 0.125, backend=backend),
          paged_decode_attention_ref(q, kc, vc, table, sl, 0.125), torch.float32)
    zero = torch.zeros_like(sl)
    assert (paged_decode_attention(q, kc, vc, table, zero, 0.125, backend=backend) == 0).all()


PREFILL = dict(q_lens=[7, 1, 23, 13], seq_lens=[7, 37, 23, 41])  # fresh (q == seq) and extends


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page", [8, 16])
@pytest.mark.parametrize("hq,hkv", GROUPS)
def test_prefill_matches_ref(backend, dtype, page, hq, hkv):
    kc, vc, table, sl = paged(PREFILL["seq_lens"], page, hkv, 64, dtype)
    cu = packed(PREFILL["q_lens"])
    q = queries((sum(PREFILL["q_lens"]), hq, 64), dtype)
    want = paged_prefill_attention_ref(q, kc, vc, table, cu, sl, 0.125)
    bound = None if page == 8 else max(PREFILL["q_lens"])  # both grid paths
    with poisoned_empty():
        got = paged_prefill_attention(q, kc, vc, table, cu, sl, 0.125, max_seqlen_q=bound, backend=backend)
    check(got, want, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_last_row_is_decode(backend):
    """A fresh prefill of L tokens: its last query sees keys 0..L-1, as decode with seq_len L does."""
    lens = [31, 5, 64]
    kc, vc, table, sl = paged(lens, 16, 2, 64, torch.float32)
    q = queries((sum(lens), 12, 64), torch.float32)
    cu = packed(lens)
    pre = paged_prefill_attention(q, kc, vc, table, cu, sl, 0.125, backend=backend)
    last = cu[1:].long() - 1
    dec = paged_decode_attention(q[last], kc, vc, table, sl, 0.125, backend=backend)
    torch.testing.assert_close(pre[last], dec, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["ref"] + BACKENDS)
def test_prefill_padding_rows_and_sequences(backend):
    """A CUDA graph's padded prefill: 41 real queries of 2 sequences, 23 rows past cu[-1] and 2
    sequences without queries or keys. The real rows equal the unpadded call's; the reference and
    torch versions give zeros on the padding (the kernel leaves it alone: not compared)."""
    lens, q_lens = [19, 30], [11, 30]
    kc, vc, table, sl = paged(lens + [0, 0], 8, 2, 64, torch.float32)
    cu = packed(q_lens + [0, 0])
    q = queries((64, 4, 64), torch.float32)
    want = paged_prefill_attention_ref(q[:41], kc, vc, table[:2], cu[:3], sl[:2], 0.125)
    with poisoned_empty():
        got = paged_prefill_attention(q, kc, vc, table, cu, sl, 0.125, max_seqlen_q=64, backend=backend)
    check(got[:41], want, torch.float32)
    if backend != "triton":
        assert not got[41:].any()


@pytest.mark.parametrize("backend", ["ref"] + BACKENDS)
def test_prefill_leaves_a_mixed_steps_decode_rows(backend):
    """A mixed step: 3 one-query sequences with history (decode rows), then 2 prompt chunks. Given
    no queries (cu_seqlens_q[0] = 3, the mixed step's prefill cu), the chunks' rows equal the call
    over every row, and the decode rows are left to the decode kernel (zeros in ref / torch)."""
    lens, q_lens = [40, 17, 9, 12, 30], [1, 1, 1, 12, 20]
    kc, vc, table, sl = paged(lens, 8, 2, 64, torch.float32)
    q = queries((sum(q_lens), 4, 64), torch.float32)
    cu = packed(q_lens)
    cu_prefill = torch.clamp(cu, min=3)
    whole = paged_prefill_attention_ref(q, kc, vc, table, cu, sl, 0.125)
    with poisoned_empty():
        got = paged_prefill_attention(q, kc, vc, table, cu_prefill, sl, 0.125, backend=backend)
    check(got[3:], whole[3:], torch.float32)
    check(paged_decode_attention(q[:3], kc, vc, table[:3], sl[:3], 0.125, backend=backend), whole[:3], torch.float32)
    if backend != "triton":
        assert not got[:3].any()


@needs_triton
def test_odd_head_dim():
    """D = 40 (not a power of two) is padded to 64 in registers and masked."""
    kc, vc, table, sl = paged([19, 0, 44], 8, 2, 40, torch.float32)
    q = queries((3, 4, 40), torch.float32)
    check(paged_decode_attention(q, kc, vc, table, sl, 0.2, backend="triton"),
          paged_decode_attention_ref(q, kc, vc, table, sl, 0.2), torch.float32)
    cu, n = packed([5, 0, 44]), torch.tensor([19, 0, 44], dtype=torch.int32, device=DEVICE)
    qp = queries((49, 4, 40), torch.float32)
    check(paged_prefill_attention(qp, kc, vc, table, cu, n, 0.2, backend="triton"),
          paged_prefill_attention_ref(qp, kc, vc, table, cu, n, 0.2), torch.float32)


@pytest.mark.parametrize("backend", ["ref"] + BACKENDS)
def test_empty_batches_and_sequences(backend):
    """B = 0 / N = 0 calls; prefill sequences with no new queries (one also without keys)."""
    kc, vc, table, sl = paged([19, 7, 44], 8, 2, 64, torch.float32)
    q = queries((49, 4, 64), torch.float32)
    empty = (0, 4, 64)
    assert paged_decode_attention(q[:0], kc, vc, table[:0], sl[:0], 0.2, backend=backend).shape == empty
    assert paged_prefill_attention(q[:0], kc, vc, table[:0], packed([]), sl[:0], 0.2, backend=backend).shape == empty
    for lens in ([19, 7, 44], [19, 0, 44]):
        n = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
        with poisoned_empty():
            got = paged_prefill_attention(q, kc, vc, table, packed([5, 0, 44]), n, 0.2, backend=backend)
        check(got, paged_prefill_attention_ref(q, kc, vc, table, packed([5, 0, 44]), n, 0.2), torch.float32)


def test_errors():
    kc, vc, table, sl = paged([5, 9], 8, 2, 64, torch.float32)
    q = queries((2, 4, 64), torch.float32)
    with pytest.raises(ValueError, match="Hq a multiple"):
        paged_decode_attention(q[:, :3], kc, vc, table, sl, 0.1)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode_attention(q, kc[:, :6], vc[:, :6], table, sl, 0.1)
    with pytest.raises(ValueError, match="dtypes"):
        paged_decode_attention(q.double(), kc, vc, table, sl, 0.1)
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention(q, kc, vc, table.float(), sl, 0.1)
    with pytest.raises(ValueError, match="block_table"):
        paged_decode_attention(q, kc, vc, table[:1], sl, 0.1)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_prefill_attention(q, kc, vc, table, packed([2]), sl, 0.1)
    with pytest.raises(ValueError, match="backend"):
        paged_decode_attention(q, kc, vc, table, sl, 0.1, backend="cuda")


# ---- GPU: full-size shapes, fp16, D 128, CUDA graphs ----

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,hq,hkv,page", [(128, 12, 2, 16), (64, 32, 32, 8), (128, 28, 4, 128), (256, 8, 1, 32)])
def test_gpu_decode_large(dtype, d, hq, hkv, page):
    lens = torch.randint(0, 1500, (61,), generator=torch.Generator().manual_seed(d + page)).tolist()
    kc, vc, table, sl = paged(lens, page, hkv, d, dtype)
    q = queries((len(lens), hq, d), dtype)
    want = paged_decode_attention_ref(q, kc, vc, table, sl, d ** -0.5)
    check(paged_decode_attention(q, kc, vc, table, sl, d ** -0.5, backend="triton"), want, dtype)
    check(paged_decode_attention(q, kc, vc, table, sl, d ** -0.5, backend="torch"), want, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,hq,hkv,page", [(128, 12, 2, 16), (64, 8, 8, 8)])
def test_gpu_prefill_large(dtype, d, hq, hkv, page):
    q_lens, seq_lens = [300, 1, 129, 77, 512], [300, 900, 1000, 77, 700]
    kc, vc, table, sl = paged(seq_lens, page, hkv, d, dtype)
    cu = packed(q_lens)
    q = queries((sum(q_lens), hq, d), dtype)
    want = paged_prefill_attention(q, kc, vc, table, cu, sl, d ** -0.5, backend="torch")
    got = paged_prefill_attention(q, kc, vc, table, cu, sl, d ** -0.5, max_seqlen_q=512, backend="triton")
    check(got, want, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [3, 200])  # rows over several programs / one program a row
def test_gpu_decode_cuda_graph(batch):
    """Capture once, then change q, seq_lens and the page table in place: replay == eager."""
    lens = torch.randint(0, 700, (batch,), generator=torch.Generator().manual_seed(batch)).tolist()
    kc, vc, table, sl = paged(lens + lens[::-1], 16, 2, 128, torch.bfloat16)  # pages for both orders
    q = queries((batch, 12, 128), torch.bfloat16)
    st_q, st_table, st_sl = q.clone(), table[:batch].clone(), sl[:batch].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compile) outside the capture
        paged_decode_attention(st_q, kc, vc, st_table, st_sl, 0.088)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(st_q, kc, vc, st_table, st_sl, 0.088)
    st_q.copy_(queries((batch, 12, 128), torch.bfloat16, seed=7))
    st_table.copy_(table[batch:])
    st_sl.copy_(sl[batch:])
    graph.replay()
    eager = paged_decode_attention(st_q, kc, vc, st_table, st_sl, 0.088)
    assert torch.equal(out, eager)
    check(out, paged_decode_attention_ref(st_q, kc, vc, st_table, st_sl, 0.088), torch.bfloat16)
