"""megarl.kernels.group_advantage: Triton and vectorized torch against the per-group spec.

Group ids are unsorted, non-contiguous, negative and > 2^32; group sizes
include 1; B crosses the kernel's 32-sample and 128-sample tiles. On CPU the
Triton path runs in the interpreter (env var set before the import).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from megarl.kernels import group_advantage, group_advantage_ref, triton_usable  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not triton_usable(torch.empty(0, device=DEVICE)),
                                  reason="Triton needs CUDA or TRITON_INTERPRET=1 before importing megarl.kernels")
BACKENDS = ["torch", pytest.param("triton", marks=needs_triton)]
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_equal_scores_give_zero(backend):
    s = torch.full((6,), 0.5, device=DEVICE)
    ids = torch.tensor([1, 1, 1, 2, 2, 2], device=DEVICE)
    assert (group_advantage(s, ids, torch.ones(6, 4, device=DEVICE), "grpo", backend=backend) == 0).all()


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
