"""megarl_kernels.gae: Triton and vectorized torch against the per-timestep spec.

On CPU the Triton path runs in the interpreter (TRITON_INTERPRET=1 must be set
before megarl_kernels is imported, hence the top of this file). Shapes are
small and odd: prime T, ragged row blocks and T chunks, empty and all-masked
rows, masked runs across chunk edges; tilings other than the shipped one and
thread-group widths VEC 1..16. Not covered
here: speed (benchmarks/bench_kernels.py), and the GPU lowering itself (the
interpreter runs the kernels' Python; `-m gpu` runs them compiled).
"""

import torch

from kernel_backends import BACKENDS, DEVICE, needs_triton  # noqa: E402  (sets TRITON_INTERPRET first)

import importlib  # noqa: E402

import pytest  # noqa: E402

from megarl_kernels import gae, gae_ref  # noqa: E402
from megarl_kernels.dispatch import tl, triton  # noqa: E402

gae_mod = importlib.import_module("megarl_kernels.gae")  # the module (the package attribute is the function)
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-5, rtol=1e-5)}


def _inputs(B, T, dtype=torch.float32, seed=0):
    """Random rewards/values and a mask with padding tails, holes, and an all-masked row."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(B, T, generator=g).to(dtype)
    v = torch.randn(B, T, generator=g).to(dtype)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]  # (B, T) response then padding
    mask &= torch.rand(B, T, generator=g) > 0.2  # holes (e.g. tool-output tokens)
    if B > 1:
        mask[1] = False
    return r.to(DEVICE), v.to(DEVICE), mask.to(DEVICE)


def test_ref_by_hand():
    """T=4, mask [1, 0, 1, 0], gamma=0.5, lam=0.5 (gamma*lam = 0.25).

    t=2: next real none -> delta = r2 - v2 = 1 - 2 = -1, A2 = -1, R2 = 1.
    t=0: next real is t=2 -> delta = r0 + 0.5 * v2 - v0 = 1 + 1 - 1 = 1,
         A0 = 1 + 0.25 * (-1) = 0.75, R0 = 1.75. Masked t=1, 3 give 0.
    """
    r = torch.tensor([[1.0, 9.0, 1.0, 9.0]])
    v = torch.tensor([[1.0, 9.0, 2.0, 9.0]])
    m = torch.tensor([[1, 0, 1, 0]])
    adv, ret = gae_ref(r, v, m, 0.5, 0.5)
    assert torch.equal(adv, torch.tensor([[0.75, 0.0, -1.0, 0.0]]))
    assert torch.equal(ret, torch.tensor([[1.75, 0.0, 1.0, 0.0]]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("B,T", [(1, 1), (3, 13), (5, 37), (2, 131)])
@pytest.mark.parametrize("whiten", [False, True])
def test_matches_ref(backend, B, T, whiten):
    r, v, m = _inputs(B, T)
    want = gae_ref(r.cpu(), v.cpu(), m.cpu(), 0.99, 0.95, whiten)
    got = gae(r, v, m, 0.99, 0.95, whiten=whiten, backend=backend)
    for w, g in zip(want, got):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.cpu(), w, **TOL[torch.float32])


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_inputs(backend):
    r, v, m = _inputs(4, 29, torch.bfloat16)
    want = gae_ref(r.cpu(), v.cpu(), m.cpu(), 1.0, 0.9, True)
    for w, g in zip(want, gae(r, v, m, 1.0, 0.9, whiten=True, backend=backend)):
        torch.testing.assert_close(g.cpu(), w, **TOL[torch.bfloat16])


def _use(monkeypatch, **consts):
    """Point megarl_kernels.gae at one tiling for this test."""
    for k, v in consts.items():
        monkeypatch.setattr(gae_mod, k, v)


@needs_triton
@pytest.mark.parametrize("whiten", [False, True])
@pytest.mark.parametrize("block_t,tile,num_warps,T", [
    (32, 64, 1, 97),  # 2-row tiles (B=3: ragged), 4 chunks (last ragged), VEC 2
    (16, 16, 4, 53),  # 1-row tiles, 4 chunks, VEC 1
    (256, 256, 1, 557),  # VEC 8 (32 groups of 8 per chunk), 3 chunks
    (512, 512, 1, 1031),  # VEC 16, 3 chunks
])
def test_triton_chunked_carry(monkeypatch, whiten, block_t, tile, num_warps, T):
    """Small BLOCK_T forces several chunks per row (prime T): carries cross chunk edges."""
    _use(monkeypatch, BLOCK_T=block_t, TILE=tile, NUM_WARPS=num_warps)
    r, v, m = _inputs(3, T, seed=1)
    want = gae_ref(r.cpu(), v.cpu(), m.cpu(), 0.97, 0.9, whiten)
    for w, g in zip(want, gae(r, v, m, 0.97, 0.9, whiten=whiten, backend="triton")):
        torch.testing.assert_close(g.cpu(), w, **TOL[torch.float32])


@needs_triton
def test_carry_across_masked_chunks(monkeypatch):
    """Real tokens far apart: the next real value and advantage cross whole masked chunks.

    Row 0 is real at t = 0, 5, 199 only, so t=5 bootstraps from v_199 across five
    all-masked 32-token chunks; row 1 is real at t = 0 only (no next real token);
    row 2 at t = 31, 32 (the two sides of a chunk edge).
    """
    _use(monkeypatch, BLOCK_T=32, TILE=32, NUM_WARPS=1)
    r, v, _ = _inputs(3, 200, seed=7)
    m = torch.zeros(3, 200, dtype=torch.bool, device=DEVICE)
    m[0, [0, 5, 199]] = True
    m[1, 0] = True
    m[2, [31, 32]] = True
    want = gae_ref(r.cpu(), v.cpu(), m.cpu(), 0.9, 0.8)
    for w, g in zip(want, gae(r, v, m, 0.9, 0.8, backend="triton")):
        torch.testing.assert_close(g.cpu(), w, **TOL[torch.float32])


@triton.jit
def _first(a, b):
    return a


@triton.jit
def _scan_first_kernel(x_ptr, out_ptr, N: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, N))
    tl.store(out_ptr + tl.arange(0, N), tl.associative_scan(x, 0, _first))


@needs_triton
def test_scan_combine_order():
    """A forward tl.associative_scan calls combine(earlier, later): `_excl_combine` relies on it.

    With combine(a, b) = a every output is x[0]; the other order would give x itself.
    """
    x = torch.arange(1.0, 65.0, device=DEVICE)
    out = torch.empty_like(x)
    _scan_first_kernel[(1,)](x, out, N=64)
    assert (out == 1.0).all()


@pytest.mark.parametrize("backend", ["ref"] + BACKENDS)
def test_masked_positions_do_not_leak(backend):
    """Changing rewards/values at masked positions changes nothing (they are skipped)."""
    r, v, m = _inputs(4, 23, seed=2)
    noise = torch.randn(r.shape, device=DEVICE) * 100
    a1, r1 = gae(r, v, m, 0.99, 0.95, backend=backend)
    a2, r2 = gae(torch.where(m, r, noise), torch.where(m, v, -noise), m, 0.99, 0.95, backend=backend)
    torch.testing.assert_close(a1, a2, atol=0, rtol=0)
    torch.testing.assert_close(r1, r2, atol=0, rtol=0)
    assert (a1[~m] == 0).all() and (r1[~m] == 0).all()


@pytest.mark.parametrize("backend", ["ref"] + BACKENDS)
def test_whiten_moments(backend):
    """Whitened advantages have mean 0 and unbiased var 1 over real tokens."""
    r, v, m = _inputs(6, 41, seed=3)
    adv, _ = gae(r, v, m, 1.0, 1.0, whiten=True, backend=backend)
    real = adv[m]
    assert abs(real.mean().item()) < 1e-5 and abs(real.var().item() - 1) < 1e-4


@pytest.mark.parametrize("backend", ["ref"] + BACKENDS)
@pytest.mark.parametrize("B,T", [(0, 7), (4, 0), (3, 5)])
def test_empty_and_all_masked(backend, B, T):
    r, v, _ = _inputs(max(B, 1), max(T, 1))
    r, v = r[:B, :T], v[:B, :T]
    m = torch.zeros(B, T, dtype=torch.bool, device=DEVICE)
    for out in gae(r, v, m, 0.99, 0.95, whiten=True, backend=backend):
        assert out.shape == (B, T) and (out == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gamma,lam", [(0.0, 0.5), (0.9, 0.0), (1.0, 1.0)])
def test_degenerate_coefficients(backend, gamma, lam):
    r, v, m = _inputs(3, 17, seed=4)
    want = gae_ref(r.cpu(), v.cpu(), m.cpu(), gamma, lam)
    for w, g in zip(want, gae(r, v, m.float(), gamma, lam, backend=backend)):  # float mask too
        torch.testing.assert_close(g.cpu(), w, **TOL[torch.float32])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_full_size():
    """B=64, T=2048 (one chunk per row), T=5000 (chunked, prime-free but ragged) and T=1031
    (prime) against the vectorized torch path, compiled for the GPU at the shipped tiling."""
    for B, T in [(64, 2048), (16, 5000), (5, 1031)]:
        r, v, m = _inputs(B, T, seed=5)
        for w, g in zip(gae(r, v, m, 0.99, 0.95, True, backend="torch"),
                        gae(r, v, m, 0.99, 0.95, True, backend="triton")):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
