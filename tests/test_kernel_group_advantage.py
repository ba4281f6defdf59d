"""megarl_kernels.group_advantage: Triton and vectorized torch against the per-group spec.

Group ids are unsorted, non-contiguous, negative and > 2^32; group sizes
include 1; B crosses the kernel's 32-sample and 128-sample tiles. On CPU the
Triton path runs in the interpreter (env var set before the import).
"""

import torch

from kernel_backends import BACKENDS, DEVICE  # noqa: E402  (sets TRITON_INTERPRET first)

import pytest  # noqa: E402

from megarl_kernels import group_advantage, group_advantage_ref  # noqa: E402

MODES = ["grpo", "drgrpo", "rloo"]


def _inputs(B, T, n_groups, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(B, generator=g).to(dtype)
    ids = torch.randint(0, n_groups, (B,), generator=g) * 1_000_003 - 7 * 2**33  # sparse, negative, > 2^32
    mask = torch.rand(B, T, generator=g) > 0.3
    if B > 2:
        mask[2] = False
    return scores.to(DEVICE), ids.to(DEVICE), mask.to(DEVICE)


def test_ref_by_hand():
    """Group {1, 2, 3}: mean 2, unbiased std 1; group {5}: size 1 -> 0.

    grpo: (s - 2) / (1 + eps); drgrpo: s - 2; rloo: 3/2 (s - 2) = s - mean(others).
    """
    s = torch.tensor([1.0, 5.0, 2.0, 3.0])
    ids = torch.tensor([9, -4, 9, 9])
    m = torch.ones(4, 2)
    eps = 1e-6
    want = {"grpo": torch.tensor([-1 / (1 + eps), 0, 0, 1 / (1 + eps)]),
            "drgrpo": torch.tensor([-1.0, 0, 0, 1]), "rloo": torch.tensor([-1.5, 0, 0, 1.5])}
    for mode, w in want.items():
        torch.testing.assert_close(group_advantage_ref(s, ids, m, mode, eps), w[:, None].expand(4, 2))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("B,T,n_groups", [(1, 5, 1), (7, 13, 3), (37, 3, 5), (161, 17, 41)])
def test_matches_ref(backend, mode, B, T, n_groups):
    s, ids, m = _inputs(B, T, n_groups)
    want = group_advantage_ref(s.cpu(), ids.cpu(), m.cpu(), mode)
    got = group_advantage(s, ids, m, mode, backend=backend)
    assert got.dtype == torch.float32 and got.shape == (B, T)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_bf16_scores_singletons_and_masks(backend, mode):
    """bf16 scores; every group of size 1 -> all zeros; masked tokens and rows -> 0."""
    s, ids, m = _inputs(23, 11, 8, torch.bfloat16, seed=1)
    want = group_advantage_ref(s.cpu(), ids.cpu(), m.cpu(), mode)
    got = group_advantage(s, ids, m.float(), mode, backend=backend)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    assert (got[~m] == 0).all()
    unique = torch.arange(5, device=DEVICE) * 3
    assert (group_advantage(s[:5], unique, m[:5], mode, backend=backend) == 0).all()


@pytest.mark.parametrize("backend", ["ref"] + BACKENDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", [2, 8, 16, 64])
def test_identical_scores_give_exactly_zero(backend, mode, n):
    """Four groups of n copies of 0.7, 0.1, 1/3, -2.3 (not dyadic: the fp32 mean
    of n copies is 1 ulp off, and (s - mean) / (std ~1e-8 + eps) was ~0.06), plus
    0.5 (dyadic), interleaved so at n=64 (B=320) a group spans several 128-wide
    tiles. Every member's advantage must be exactly 0 (shifted data: s_j - pivot)."""
    values = torch.tensor([0.7, 0.1, 1 / 3, -2.3, 0.5])
    s = values.repeat(n).to(DEVICE)  # (5n,) member k of group g at k * 5 + g
    ids = (torch.arange(5).repeat(n) * 1_000_003 - 2**40).to(DEVICE)
    out = group_advantage(s, ids, torch.ones(5 * n, 3, device=DEVICE), mode, backend=backend)
    assert (out == 0).all(), out.abs().max()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_near_identical_scores_match_fp64_spec(backend, mode):
    """Groups of 16 around 0.7 and -2.3, a few members 1-3 ulps up: std ~1e-7, so
    grpo's advantage is ~(s - mean) / eps, where an fp32 mean 1 ulp off moves it
    by ~0.06. The fp64 ref is the spec; fp32 paths must agree to 1e-5."""
    g = torch.Generator().manual_seed(3)
    base = torch.tensor([0.7, -2.3]).repeat_interleave(16)  # (32,)
    s = base.clone()
    for _ in range(3):
        s = torch.where(torch.rand(32, generator=g) < 0.3, torch.nextafter(s, torch.tensor(10.0)), s)
    ids = torch.tensor([4, -9]).repeat_interleave(16)
    m = torch.ones(32, 2)
    want = group_advantage_ref(s, ids, m, mode)
    assert (want != 0).any()  # the groups are not all identical
    got = group_advantage(s.to(DEVICE), ids.to(DEVICE), m.to(DEVICE), mode, backend=backend)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["ref"] + BACKENDS)
@pytest.mark.parametrize("B,T", [(0, 5), (3, 0)])
def test_empty(backend, B, T):
    s, ids, m = _inputs(max(B, 1), max(T, 1), 2)
    out = group_advantage(s[:B], ids[:B], m[:B, :T], backend=backend)
    assert out.shape == (B, T)


def test_mode_aliases_and_errors():
    s, ids, m = _inputs(9, 3, 2)
    torch.testing.assert_close(group_advantage(s, ids, m, "std"), group_advantage(s, ids, m, "grpo"))
    torch.testing.assert_close(group_advantage(s, ids, m, "mean"), group_advantage(s, ids, m, "drgrpo"))
    with pytest.raises(ValueError, match="mode"):
        group_advantage(s, ids, m, "nope")
    with pytest.raises(ValueError, match="backend"):
        group_advantage(s, ids, m, backend="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_full_size():
    s, ids, m = _inputs(8192, 1024, 512, seed=2)
    for mode in MODES:
        torch.testing.assert_close(group_advantage(s, ids, m, mode, backend="triton"),
                                   group_advantage(s, ids, m, mode, backend="torch"), atol=1e-5, rtol=1e-5)
