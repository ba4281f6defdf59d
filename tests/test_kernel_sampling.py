"""megarl_kernels.sampling: Triton and vectorized torch against the per-row spec.

Vocab sizes are odd (57, 1000, 5003) with padding columns past vocab_size; rows
in one batch mix greedy, temperature-only, top-k, top-p, both, and off-values
(top_k <= 0 or >= vocab, top_p = 1). Seeds are negative and > 2^32. On CPU the
Triton path runs in the interpreter (env var set before the import), so
shapes stay small; the full-size check and CUDA-graph capture are GPU-only.
Not covered: NaN logits, temperatures so small that l / T overflows.
"""

import torch

from kernel_backends import BACKENDS, DEVICE, needs_triton  # noqa: E402  (sets TRITON_INTERPRET first)

import pytest  # noqa: E402

from megarl_kernels import triton_usable  # noqa: E402
from megarl_kernels.sampling import (  # noqa: E402
    _keep_ref,
    sample_tokens,
    sample_tokens_ref,
    sample_tokens_triton,
)
from megarl_kernels.sampling_noise import uniform_noise, uniform_noise_ref  # noqa: E402

MODES = ["greedy", "temperature", "top_k", "top_p", "top_k_top_p", "mixed"]


def _seeds(B, g):
    seeds = torch.randint(-2**62, 2**62, (B,), generator=g)
    seeds[: min(B, 4)] = torch.tensor([0, -1, 2**32 + 5, -(2**40) - 3])[: min(B, 4)]
    return seeds, torch.randint(0, 2**40, (B,), generator=g)


def _settings(mode, B, n, g):
    """Per-row (temperature (B,), top_k (B,) int32, top_p (B,)) for a mode."""
    temp = torch.rand(B, generator=g) * 1.5 + 0.3
    top_k = torch.zeros(B, dtype=torch.int32)
    top_p = torch.ones(B)
    if mode == "greedy":
        temp.zero_()
    if mode in ("top_k", "top_k_top_p"):
        top_k = torch.randint(1, max(2, n // 3), (B,), generator=g, dtype=torch.int32)
    if mode in ("top_p", "top_k_top_p"):
        top_p = torch.rand(B, generator=g) * 0.9 + 0.05
    if mode == "mixed":  # cycle: greedy, T only, top-k, top-p, both, k = 1, k off (>= n, < 0), p = 1
        kinds = torch.arange(B) % 8
        temp[kinds == 0] = 0.0
        top_k[kinds == 2], top_k[kinds == 4], top_k[kinds == 5] = 7, n // 2, 1
        top_k[kinds == 6], top_k[kinds == 7] = n + 3, -2
        top_p[kinds == 3], top_p[kinds == 4], top_p[kinds == 7] = 0.6, 0.85, 1.0
    return temp, top_k, top_p


def _case(B, V, n, mode, dtype=torch.float32, seed=0, ties=False):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=g) * 3
    if ties:  # many exact ties, at the top-k / top-p boundaries too
        logits = torch.randint(-4, 4, (B, V), generator=g).float()
    logits[:, n:] = 1e4  # padding: huge, must never be sampled nor enter a softmax
    args = (logits.to(dtype), *_settings(mode, B, n, g), *_seeds(B, g))
    return [a.to(DEVICE) for a in args]


def _check(got, want, atol=1e-5):
    assert got[0].dtype == torch.int64 and got[1].dtype == torch.float32
    assert torch.equal(got[0].cpu(), want[0].cpu())
    torch.testing.assert_close(got[1].cpu(), want[1].cpu(), atol=atol, rtol=1e-5)


# ---- the hash ----

@pytest.mark.parametrize("backend", BACKENDS)
def test_noise_bit_identical(backend):
    g = torch.Generator().manual_seed(0)
    seeds, offsets = _seeds(9, g)
    offsets[0], offsets[1] = 0, 2**40 + 1
    want = uniform_noise_ref(seeds, offsets, 257)
    got = uniform_noise(seeds.to(DEVICE), offsets.to(DEVICE), 257, backend=backend).cpu()
    assert got.dtype == torch.float32 and torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert want.min() > 0 and want.max() < 1
    assert want.unique().numel() > 0.99 * want.numel()  # rows and columns do not repeat each other


def test_noise_golden_values():
    """Pins the hash: tokens for a (seed, offset) must not change between versions."""
    want = [["0x1.d68bacp-2", "0x1.a54044p-2", "0x1.fbeb40p-3"],
            ["0x1.f9ba34p-2", "0x1.2666e6p-1", "0x1.aad02ep-3"],
            ["0x1.ab325ep-2", "0x1.2b5bf2p-1", "0x1.5ab102p-2"]]
    got = uniform_noise_ref(torch.tensor([0, -1, 2**40 + 7]), torch.tensor([0, 5, 2**33]), 3)
    assert got.tolist() == [[float.fromhex(x) for x in row] for row in want]


def test_noise_extremes_and_moments():
    """2^18 draws: mean 1/2 and variance 1/12 within 5 standard errors; never 0 or 1."""
    u = uniform_noise_ref(torch.arange(64) - 32, torch.full((64,), 3), 4096).double()
    se = (1 / 12 / u.numel()) ** 0.5
    assert abs(u.mean() - 0.5) < 5 * se and abs(u.var() - 1 / 12) < 5 * 0.0745 / u.numel() ** 0.5
    assert u.min() > 0 and u.max() < 1


# ---- against the spec ----

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("B,V,n", [(7, 57, 57), (8, 1000, 997)])
def test_matches_ref(backend, dtype, mode, B, V, n):
    args = _case(B, V, n, mode, dtype)
    _check(sample_tokens(*args, vocab_size=n, backend=backend), sample_tokens_ref(*[a.cpu() for a in args], n))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_ref_5003(backend, dtype):
    args = _case(8, 5011, 5003, "mixed", dtype, seed=3)
    _check(sample_tokens(*args, vocab_size=5003, backend=backend), sample_tokens_ref(*[a.cpu() for a in args], 5003))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["top_k", "top_p", "mixed"])
def test_ties_match_ref(backend, mode):
    """Integer logits: ties at the k-th value and inside the top-p prefix are all kept."""
    args = _case(8, 203, 200, mode, seed=5, ties=True)
    _check(sample_tokens(*args, vocab_size=200, backend=backend), sample_tokens_ref(*[a.cpu() for a in args], 200))


@needs_triton
@pytest.mark.parametrize("block,splits", [(64, 3), (32, 7)])
def test_triton_row_split(block, splits):
    """Rows split over several programs (the GPU's small-batch layout) merge to the same answer."""
    args = _case(8, 301, 299, "mixed", seed=7)
    _check(sample_tokens_triton(*args, vocab_size=299, block=block, splits=splits),
           sample_tokens_ref(*[a.cpu() for a in args], 299))


@pytest.mark.parametrize("backend", ["ref"] + BACKENDS)
def test_greedy_lowest_index_and_top_k_1(backend):
    g = torch.Generator().manual_seed(1)
    B, V, n = 6, 41, 37
    logits = torch.randint(0, 3, (B, V), generator=g).float()  # ties at the max
    seeds, offsets = _seeds(B, g)
    zeros, ones = torch.zeros(B, dtype=torch.int32), torch.ones(B)
    t = sample_tokens(*(x.to(DEVICE) for x in (logits, torch.zeros(B), zeros, ones, seeds, offsets)),
                      vocab_size=n, backend=backend)[0].cpu()
    is_max = logits[:, :n] == logits[:, :n].amax(-1, keepdim=True)
    assert torch.equal(t, is_max.int().argmax(-1))  # first maximal index
    distinct = torch.randn(B, V, generator=g)
    k1 = sample_tokens(*(x.to(DEVICE) for x in (distinct, torch.full((B,), 0.8), zeros + 1, ones, seeds, offsets)),
                       vocab_size=n, backend=backend)[0].cpu()
    assert torch.equal(k1, distinct[:, :n].argmax(-1))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["temperature", "top_k_top_p", "mixed"])
def test_padding_never_sampled_and_logprob(backend, mode):
    """Padding holds 1e4: any leak into a softmax or the race shows. logprob is log_softmax(l / T) on [0, n)."""
    B, V, n = 16, 67, 50
    args = _case(B, V, n, mode, seed=2)
    args[0][:, 45:50] = float("-inf")  # masked real tokens: never sampled either
    tok, lp = sample_tokens(*args, vocab_size=n, backend=backend)
    assert (tok < 45).all()
    t = torch.where(args[1] > 0, args[1], 1.0)
    want = torch.log_softmax(args[0][:, :n].float() / t[:, None], -1).gather(-1, tok[:, None])[:, 0]
    torch.testing.assert_close(lp, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_invariance(backend):
    """A row's token depends on its own (logits, settings, seed, offset) only: alone, reordered, or among others."""
    B, V, n = 8, 130, 127
    args = _case(B, V, n, "mixed", seed=4)
    full = sample_tokens(*args, vocab_size=n, backend=backend)
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    shuffled = sample_tokens(*(a[perm] for a in args), vocab_size=n, backend=backend)
    _check(shuffled, (full[0][perm], full[1][perm]), atol=0)
    others = _case(5, V, n, "mixed", seed=9)
    for b in (0, 3, 4):
        alone = sample_tokens(*(a[b:b + 1] for a in args), vocab_size=n, backend=backend)
        mixed = sample_tokens(*(torch.cat([o[:2], a[b:b + 1], o[2:]]) for o, a in zip(others, args)),
                              vocab_size=n, backend=backend)
        assert alone[0].item() == full[0][b].item() == mixed[0][2].item()
        assert alone[1].item() == full[1][b].item() == mixed[1][2].item()


# ---- the distribution ----

# 99.99th percentiles of chi-square with d degrees of freedom (d = kept tokens - 1).
CHI2_9999 = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86, 7: 29.88}
LOGITS8 = [2.0, 1.5, 1.5, 1.0, 0.5, 0.0, -0.5, -1.5]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("top_k,top_p,kept,over", [(0, 1.0, 8, "seeds"), (2, 1.0, 3, "seeds"),
                                                   (0, 0.5, 3, "offsets"), (0, 0.8, 4, "offsets"),
                                                   (5, 0.9, 4, "seeds")])
def test_distribution(backend, top_k, top_p, kept, over):
    """4000 draws of one V=8 row at T = 0.8, each with its own seed (or offset of one seed).

    s = l / 0.8 has probs .378 .202 .202 .108 .058 .031 .017 .005. Expected
    frequencies: softmax(s) restricted to the kept set, renormalized:
      top_k=2            {0, 1, 2}     the tie at the 2nd value is kept
      top_p=0.5          {0, 1, 2}     prefix .38, .58 >= .5 ends on a tie: both kept
      top_p=0.8          {0, 1, 2, 3}  .38 .58 .78 < .8 <= .89
      top_k=5, top_p=0.9 {0, 1, 2, 3}  top-5 renormalized, cum: .40 .61 .82 < .9 <= .94
    Pearson's X^2 = sum (O - E)^2 / E over the kept tokens (every E >= 19) is
    close to chi-square with kept - 1 dof; the bound is its 99.99th percentile,
    so a correct sampler fails for about 1 in 10^4 seed sets (the seeds are
    fixed: the test always passes or always fails). Tokens outside the kept set
    must never appear.
    """
    N = 4000
    logits = torch.tensor(LOGITS8).repeat(N, 1)
    idx = torch.arange(N)
    seeds, offsets = (idx * 7919 - 10**12, torch.full((N,), 11)) if over == "seeds" else \
        (torch.full((N,), 123456789), idx)
    rows = (logits, torch.full((N,), 0.8), torch.full((N,), top_k, dtype=torch.int32), torch.full((N,), top_p),
            seeds, offsets)
    tok = sample_tokens(*(x.to(DEVICE) for x in rows), backend=backend)[0].cpu()
    s = torch.tensor(LOGITS8) / 0.8
    keep = _keep_ref(s, top_k, top_p)
    assert int(keep.sum()) == kept
    p = torch.softmax(torch.where(keep, s, float("-inf")), -1).double()
    counts = torch.bincount(tok, minlength=8).double()
    assert counts[~keep].sum() == 0
    x2 = ((counts - N * p)[keep] ** 2 / (N * p[keep])).sum()
    assert x2 < CHI2_9999[kept - 1] if kept > 1 else counts[keep].sum() == N, (counts, N * p)


# ---- errors, empty ----

@pytest.mark.parametrize("backend", ["ref"] + BACKENDS)
def test_out_buffer(backend):
    """out= (2, B) fp32 rows of a wider buffer, as the decode graphs pass it: the same tokens (as fp32)
    and log-probs as the returned tensors, nothing written past column B; a wrong out is refused."""
    args = _case(8, 1000, 997, "mixed", torch.bfloat16, seed=5)
    want = sample_tokens(*args, vocab_size=997, backend=backend)
    wide = torch.full((2, 11), -3.0, device=DEVICE)
    got = sample_tokens(*args, vocab_size=997, backend=backend, out=wide[:, :8])
    assert got[0].data_ptr() == wide[0].data_ptr() and got[1].data_ptr() == wide[1].data_ptr()
    assert torch.equal(wide[0, :8].long().cpu(), want[0].cpu()) and torch.equal(wide[1, :8].cpu(), want[1].cpu())
    assert (wide[:, 8:] == -3.0).all()
    with pytest.raises(ValueError, match="out must be"):
        sample_tokens(*args, vocab_size=997, backend=backend, out=torch.empty(2, 8, dtype=torch.float64, device=DEVICE))


def test_errors_and_empty():
    args = _case(3, 10, 10, "mixed")
    with pytest.raises(ValueError, match="backend"):
        sample_tokens(*args, backend="cuda")
    with pytest.raises(ValueError, match="vocab_size"):
        sample_tokens(*args, vocab_size=11)
    with pytest.raises(ValueError, match=r"\(B,\)"):
        sample_tokens(args[0], args[1][:2], *args[2:])
    for backend in ["ref", "torch"] + (["triton"] if triton_usable(args[0]) else []):
        tok, lp = sample_tokens(*(a[:0] for a in args), backend=backend)
        assert tok.shape == (0,) and lp.shape == (0,)


# ---- GPU: full size, CUDA graphs ----

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_full_size_and_graph(dtype):
    """B=128, V=151936: Triton == torch tokens; a captured graph replays to the eager result, new inputs too."""
    B, V = 128, 151936
    args = _case(B, V, V - 1000, "mixed", dtype, seed=11)
    tri = sample_tokens(*args, vocab_size=V - 1000, backend="triton")
    _check(tri, sample_tokens(*args, vocab_size=V - 1000, backend="torch"), atol=1e-4)
    static = [a.clone() for a in args]
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        sample_tokens(*static, vocab_size=V - 1000, backend="triton")  # warm-up: compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sample_tokens(*static, vocab_size=V - 1000, backend="triton")
    graph.replay()
    _check(out, tri, atol=0)
    new = _case(B, V, V - 1000, "mixed", dtype, seed=12)
    for s, a in zip(static, new):
        s.copy_(a)
    static[-1] += 1  # next token index
    graph.replay()
    _check(out, sample_tokens(*static, vocab_size=V - 1000, backend="triton"), atol=0)


@pytest.mark.parametrize("mode", ["top_p", "top_k_top_p", "mixed"])
def test_torch_flat_rows_histogram(monkeypatch, mode):
    """torch top-p rows whose prefix exceeds TOP_P_CANDIDATES (flat rows) take the histogram path."""
    import megarl_kernels.sampling as sampling

    calls = []
    hist = sampling._top_p_hist
    monkeypatch.setattr(sampling, "_top_p_hist", lambda *a: calls.append(1) or hist(*a))
    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", 4)
    monkeypatch.setattr(sampling, "TOP_P_BINS", 16)
    for V, n, ties in [(1000, 997, False), (203, 200, True)]:
        args = [a.cpu() for a in _case(8, V, n, mode, seed=6, ties=ties)]
        args[0] = args[0] / 4  # flatter rows: long top-p prefixes
        _check(sample_tokens(*args, vocab_size=n, backend="torch"), sample_tokens_ref(*args, n))
    assert len(calls) >= 2
