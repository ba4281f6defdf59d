"""megarl_kernels.paged_decode.rope_paged_decode: a decode step's RoPE, K/V cache write and attention
in one launch, against its spec (`rope_cache`, then paged decode attention).

Each case: a NaN-filled paged cache holding every row's earlier keys (`paged`, shuffled pages), one
fused QKV row per sequence, position = seq_len - 1 and the row's new slot = the cache slot of that
last key, poisoned to NaN first, so a tile read before the write turns the output into NaN. Checked:
the output (per-dtype tolerance) and both caches afterwards (the step's slots hold the spec's K/V,
every other slot is untouched). 1, 2, 3, 7 and 13 programs over the rows' 11 64-key tiles: the new
key's tile is read by a program that reads other rows' tiles too, rows are cut and merged, and 13
leaves programs without tiles. One padded row (0 keys) writes to the scratch page and gives zeros. Under the interpreter the fused queries are rope_cache's bit for bit,
so the output equals the two-launch Triton path exactly; on the GPU (compiled dots) within
tolerance, and a CUDA-graph replay equals an eager call exactly. Not covered on CPU: the GPU's
memory ordering between the write and the tile loads, and between a row's programs and the merging one
(the `gpu` tests run those).
"""
import torch

from kernel_backends import BACKENDS, DEVICE, needs_triton  # noqa: E402  (sets TRITON_INTERPRET first)

import pytest  # noqa: E402

from megarl_kernels.paged_decode import (  # noqa: E402
    paged_decode_attention_triton,
    qkv_rows_ref,
    rope_paged_decode,
    split_semaphores,
)
from megarl_kernels.rope_cache import rope_cache  # noqa: E402
from test_kernel_paged_attention import TOL, check, paged, poisoned_empty, queries  # noqa: E402

LENS = [1, 0, 7, 16, 64, 65, 131, 53]  # one key (the new one), a padded row, page and tile edges


def rope_tables(n: int, d: int, dtype):
    freqs = torch.outer(torch.arange(float(n)), 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    freqs = torch.cat([freqs, freqs], -1).to(DEVICE)
    return torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)


def decode_step(lens, page, hkv, g, d, dtype, seed=0):
    """(qkv, cos, sin, positions, slots, k_cache, v_cache, block_table, seq_lens) of one decode step."""
    kc, vc, table, sl = paged(lens, page, hkv, d, dtype, seed=seed)
    pos = (sl.long() - 1).clamp(min=0)
    slot = table.long().gather(1, (pos // page)[:, None])[:, 0] * page + pos % page
    slot = torch.where(sl > 0, slot, 0)  # the padded row: scratch page 0
    kc.view(-1, hkv, d)[slot] = float("nan")
    vc.view(-1, hkv, d)[slot] = float("nan")
    qkv = queries((len(lens), hkv * (g + 2) * d), dtype, seed=seed + 1)
    return (qkv, *rope_tables(max(lens) + 1, d, dtype), pos, slot, kc, vc, table, sl)


def run(step, backend, programs=None, bias=None):
    """The step on fresh copies of its caches: (out, k_cache, v_cache)."""
    qkv, cos, sin, pos, slot, kc, vc, table, sl = step
    kc, vc = kc.clone(), vc.clone()
    g = qkv.shape[-1] // (kc.shape[2] * kc.shape[3]) - 2
    with poisoned_empty():
        out = rope_paged_decode(qkv, cos, sin, pos, slot, kc, vc, table, sl, 0.125, g, backend=backend,
                                programs=programs, bias=bias)
    return out, kc, vc


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("programs", [None, 1, 2, 3, 7, 13])
@pytest.mark.parametrize("page,hkv,g", [(16, 2, 6), (8, 1, 1)])
def test_matches_spec(backend, dtype, programs, page, hkv, g):
    step = decode_step(LENS, page, hkv, g, 64, dtype, seed=programs or 0)
    want, kc_want, vc_want = run(step, "ref")
    got, kc, vc = run(step, backend, programs)
    check(got, want, dtype)
    assert (got[LENS.index(0)] == 0).all()
    for cache, ref in ((kc, kc_want), (vc, vc_want)):
        torch.testing.assert_close(cache[1:], ref[1:], equal_nan=True, **TOL[dtype])  # page 0: scratch
        written = cache.view(-1, hkv, 64)[step[4][step[8] > 0]]
        assert not written.isnan().any()


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("programs", [1, 3])
def test_equals_two_launches(dtype, programs):
    """Bitwise under the interpreter: the same queries, the same tiles, the same merge."""
    qkv, cos, sin, pos, slot, kc, vc, table, sl = step = decode_step(LENS, 16, 2, 6, 64, dtype, seed=3)
    got, kc_got, vc_got = run(step, "triton", programs)
    q = rope_cache(qkv, cos, sin, pos, slot, kc, vc, 2, 6, backend="triton")
    want = paged_decode_attention_triton(q, kc, vc, table, sl, 0.125, programs=programs)
    if DEVICE == "cpu":
        assert torch.equal(got, want)
    else:
        check(got, want, dtype)
    assert torch.equal(kc_got.nan_to_num(), kc.nan_to_num()) and torch.equal(vc_got.nan_to_num(), vc.nan_to_num())


def check_same_step(got_step, want_step, backend, dtype):
    """(out, k_cache, v_cache) of two calls: fp32, the torch backend and the GPU bitwise; bf16 in the
    interpreter within tolerance (it truncates fp32 -> bf16 where torch rounds)."""
    (got, kc, vc), (want, kc_want, vc_want) = got_step, want_step
    if dtype == torch.float32 or backend == "torch" or DEVICE == "cuda":
        assert torch.equal(got, want)
        for cache, ref in ((kc, kc_want), (vc, vc_want)):
            assert torch.equal(cache.nan_to_num(), ref.nan_to_num())
    else:  # truncations (the sum, + bias, the RoPE products) against torch's roundings
        loose = dict(rtol=5e-2, atol=1e-1)
        assert got.dtype == dtype and not got.isnan().any()
        torch.testing.assert_close(got.float(), want.float(), **loose)
        torch.testing.assert_close(kc.float(), kc_want.float(), equal_nan=True, **loose)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_rows_and_bias(backend, dtype):
    """Plain (B, W) QKV rows plus a bias (an unsplit decode step): the kernel's bias add, after the
    matmul's rounding as megatron adds it, equals the rows with the bias added first."""
    step = decode_step(LENS, 16, 2, 6, 64, dtype, seed=4)
    bias = queries(step[0].shape[1:], dtype, seed=10)
    check_same_step(run(step, backend, 3, bias=bias), run((step[0] + bias, *step[1:]), backend, 3), backend, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_partials_and_bias(backend, dtype):
    """qkv as (3, B, W) fp32 split-K partials plus a bias: the rows they sum to (`qkv_rows_ref`) in the
    plain call. fp32 bitwise; bf16 on the GPU bitwise, in the interpreter (which truncates fp32 -> bf16
    where torch rounds) within tolerance."""
    step = decode_step(LENS, 16, 2, 6, 64, dtype, seed=4)
    parts = torch.stack([queries(step[0].shape, torch.float32, seed=s) for s in (7, 8, 9)])
    bias = queries(step[0].shape[1:], dtype, seed=10)
    rows = qkv_rows_ref(parts, bias, dtype)
    assert torch.equal(rows, ((parts[0] + parts[1]) + parts[2]).to(dtype) + bias)
    check_same_step(run((parts, *step[1:]), backend, 3, bias=bias), run((rows, *step[1:]), backend, 3), backend, dtype)
    with pytest.raises(ValueError, match="fp32 partials"):
        rope_paged_decode(parts.to(torch.float16), *step[1:], 0.1, 6)
    with pytest.raises(ValueError, match="bias must be"):
        rope_paged_decode(parts, *step[1:], 0.1, 6, bias=bias[:-1])


@needs_triton
def test_split_counters_return_to_zero():
    """Each (row, kv head)'s last program zeroes its arrival counter: the next call starts from 0."""
    step = decode_step(LENS, 16, 2, 6, 64, torch.float32)
    first, _, _ = run(step, "triton", 5)
    assert not split_semaphores(len(LENS) * 2, torch.device(DEVICE))[: len(LENS) * 2].any()
    again, _, _ = run(step, "triton", 5)
    assert torch.equal(first, again)


def test_errors():
    qkv, cos, sin, pos, slot, kc, vc, table, sl = decode_step([5, 9], 8, 2, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="qkv must be"):
        rope_paged_decode(qkv[:, :-64], cos, sin, pos, slot, kc, vc, table, sl, 0.1, 2)
    with pytest.raises(ValueError, match="contiguous"):
        rope_paged_decode(qkv, cos, sin, pos, slot, kc.transpose(0, 1).contiguous().transpose(0, 1), vc, table, sl,
                          0.1, 2)


def test_torch_path_is_the_two_ops():
    """backend="torch": rope_cache's spec, then the vectorized paged decode: the spec's caches exactly, its output
    within fp32 rounding."""
    step = decode_step(LENS, 16, 2, 6, 64, torch.float32, seed=5)
    (ref, kr, vr), (tor, kt, vt) = run(step, "ref"), run(step, "torch")
    check(tor, ref, torch.float32)
    assert torch.equal(kr.nan_to_num(), kt.nan_to_num()) and torch.equal(vr.nan_to_num(), vt.nan_to_num())


# ---- GPU: full-size shapes, CUDA graphs ----

@pytest.mark.gpu
@pytest.mark.parametrize("batch", [3, 128, 512])  # rows over several programs / one program a row (wide, narrow tiles)
def test_gpu_graph_equals_eager(batch):
    """bf16, the 1.5B layer (12 query heads, 2 kv heads, D 128, page 16): the captured call replayed
    equals an eager call bitwise (caches included) and the spec within bf16 tolerance."""
    lens = torch.randint(1, 900, (batch,), generator=torch.Generator().manual_seed(batch)).tolist()
    step = decode_step(lens, 16, 2, 6, 128, torch.bfloat16, seed=batch)
    qkv, cos, sin, pos, slot, kc0, vc0, table, sl = step
    kc, vc = kc0.clone(), vc0.clone()
    call = lambda: rope_paged_decode(qkv, cos, sin, pos, slot, kc, vc, table, sl, 0.125, 6)  # run()'s scale  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()  # compile and allocate outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    kc.copy_(kc0), vc.copy_(vc0)
    graph.replay()
    replayed, kc_r, vc_r = out.clone(), kc.clone(), vc.clone()
    kc.copy_(kc0), vc.copy_(vc0)
    assert torch.equal(call(), replayed)
    assert torch.equal(kc.nan_to_num(), kc_r.nan_to_num()) and torch.equal(vc.nan_to_num(), vc_r.nan_to_num())
    want, _, _ = run(step, "torch")
    check(replayed, want, torch.bfloat16)
