"""megarl_kernels add_rms_norm, rope_cache, silu_mul (and swiglu's backward), feed_tokens: Triton against the specs
on odd shapes.

Shapes: rows 1 and 7, hidden 100 (not a power of two), head dims 32 and 64,
query heads per group 1, 2 and 6, caches with shuffled target rows and
NaN-poisoned everywhere else (a wrong row shows up as a changed NaN or a
NaN left where a value belongs). fp32 must agree to rounding (1e-5 relative);
bf16 to one rounding step of the output (the kernels round where torch rounds,
but exp / rsqrt may differ in the last fp32 bit). On CPU the Triton path runs
in the interpreter, whose fp32 -> bf16 conversion truncates (seen with Triton
3.9) where the GPU rounds to nearest: there the bf16 residual add is checked
to one step, on the GPU bitwise.
"""

import torch

from kernel_backends import DEVICE, needs_triton  # noqa: E402  (sets TRITON_INTERPRET first)

import pytest  # noqa: E402

from megarl_kernels import interpret_mode  # noqa: E402
from megarl_kernels.feed_tokens import feed_tokens, feed_tokens_ref  # noqa: E402
from megarl_kernels.rms_norm import add_rms_norm, add_rms_norm_ref, sum_parts_ref  # noqa: E402
from megarl_kernels.rope_cache import rope_cache, rope_cache_ref  # noqa: E402
from megarl_kernels.swiglu import silu_mul, silu_mul_ref, swiglu  # noqa: E402

pytestmark = needs_triton
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


def _rand(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,with_residual", [(1, False), (7, True)])
def test_add_rms_norm(dtype, rows, with_residual):
    x = _rand(rows, 100, dtype=dtype, seed=1)
    r = _rand(rows, 100, dtype=dtype, seed=2) if with_residual else None
    w = _rand(100, dtype=torch.float32, seed=3) + 1.0  # fp32 weight beside bf16 rows, as the local spec
    y, s = add_rms_norm(x, r, w, 1e-6, backend="triton")
    y_ref, s_ref = add_rms_norm_ref(x, r, w, 1e-6)
    assert y.dtype == dtype
    if dtype == torch.float32 or not interpret_mode():
        assert torch.equal(s, s_ref)  # the residual add rounds exactly as torch's
    torch.testing.assert_close(s, s_ref, **TOL[dtype])
    torch.testing.assert_close(y, y_ref, **TOL[dtype])
    y_t, _ = add_rms_norm(x, r, w, 1e-6, backend="torch")  # torch's own rms_norm is the spec
    torch.testing.assert_close(y_t, y_ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parts", [1, 3])
def test_add_rms_norm_sums_split_k_partials(dtype, parts):
    """x as (S, T, h) fp32 partials: summed in order, rounded to the residual's dtype, then the plain op."""
    x = _rand(parts, 7, 100, dtype=torch.float32, seed=6) * 3
    r = _rand(7, 100, dtype=dtype, seed=7)
    w = _rand(100, dtype=torch.float32, seed=8) + 1.0
    summed = sum_parts_ref(x, dtype)
    assert torch.equal(sum_parts_ref(x, torch.float32), x.sum(0) if parts == 1 else (x[0] + x[1]) + x[2])
    y, s = add_rms_norm(x, r, w, 1e-6, backend="triton")
    y_one, s_one = add_rms_norm(summed, r, w, 1e-6, backend="triton")
    assert y.dtype == s.dtype == dtype
    if dtype == torch.float32 or not interpret_mode():  # the interpreter truncates fp32 -> bf16
        assert torch.equal(y, y_one) and torch.equal(s, s_one)
    y_ref, s_ref = add_rms_norm_ref(x, r, w, 1e-6)
    torch.testing.assert_close(s, s_ref, **TOL[dtype])
    torch.testing.assert_close(y, y_ref, **TOL[dtype])
    y_t, s_t = add_rms_norm(x, r, w, 1e-6, backend="torch")
    assert torch.equal(s_t, s_ref)
    torch.testing.assert_close(y_t, y_ref, **TOL[dtype])
    for bad, res in ((x.to(dtype) if dtype != torch.float32 else x[:, :3], r), (x, None)):
        with pytest.raises(ValueError, match="partial sums"):
            add_rms_norm(bad, res, w, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups,per_group,d", [(2, 1, 32), (1, 2, 64), (2, 6, 32)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_rope_cache(dtype, groups, per_group, d, with_bias):
    t, pages, page = 7, 6, 4
    qkv = _rand(t, groups * (per_group + 2) * d, dtype=dtype, seed=4)
    bias = _rand(qkv.shape[-1], dtype=dtype, seed=9) if with_bias else None
    pos = torch.tensor([0, 3, 5, 1, 17, 9, 2], device=DEVICE)
    freqs = torch.outer(torch.arange(32.0), 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    freqs = torch.cat([freqs, freqs], -1).to(DEVICE)
    cos, sin = torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)
    slots = torch.randperm(pages * page, generator=torch.Generator().manual_seed(5))[:t].to(DEVICE)
    caches = [torch.full((pages, page, groups, d), float("nan"), dtype=dtype, device=DEVICE) for _ in range(4)]
    q = rope_cache(qkv, cos, sin, pos, slots, caches[0], caches[1], groups, per_group, backend="triton", bias=bias)
    q_ref = rope_cache_ref(qkv if bias is None else qkv + bias, cos, sin, pos, slots, caches[2], caches[3], groups,
                           per_group)  # the bias added as megatron's linear does: rounded once, before RoPE
    tol = TOL[dtype]
    if with_bias and dtype == torch.bfloat16 and DEVICE != "cuda":  # the interpreter truncates fp32 -> bf16
        tol = dict(rtol=5e-2, atol=1e-1)  # (the sum with the bias) where torch rounds; the GPU rounds too
    torch.testing.assert_close(q, q_ref, **tol)
    for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
        torch.testing.assert_close(got, want, equal_nan=True, **tol)  # same rows written, rest NaN
    assert not caches[1].view(-1, groups, d)[slots].isnan().any()
    if with_bias:
        with pytest.raises(ValueError, match="bias must be"):
            rope_cache(qkv, cos, sin, pos, slots, caches[0], caches[1], groups, per_group, bias=bias[:-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,f", [(1, 50), (7, 1100)])
def test_silu_mul(dtype, rows, f):
    x = _rand(rows, 2 * f, dtype=dtype, seed=6) * 3
    torch.testing.assert_close(silu_mul(x, backend="triton"), silu_mul_ref(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 100), (3, 5, 2200)])
def test_swiglu_grad_equals_autograd_of_the_spec(dtype, shape):
    """The fused backward gives the gradient torch's autograd computes through silu(gate) * up."""
    x = (_rand(*shape, dtype=dtype, seed=7) * 3).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    dout = _rand(*shape[:-1], shape[-1] // 2, dtype=dtype, seed=8)
    out = swiglu(x, backend="triton")
    out.backward(dout)
    out_ref = silu_mul_ref(x_ref)
    out_ref.backward(dout)
    assert out.shape == out_ref.shape and x.grad.dtype == dtype
    torch.testing.assert_close(out, out_ref, **TOL[dtype])
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL[dtype])
    with pytest.raises(ValueError, match="even"):
        swiglu(x[..., :-1], backend="triton")


@pytest.mark.parametrize("rows", [1, 7, 1500])
def test_feed_tokens(rows):
    """Rows fed from the last replays' outputs (token ids as fp32, up to 2^24 - 1) or kept from the host's
    ids, on strided views of one (2, B) buffer as the graphs pass them; 1,500 rows take two programs."""
    g = torch.Generator().manual_seed(rows)
    outputs = torch.randint(0, 2**24, (4 * rows,), generator=g).float()
    buf = torch.stack([torch.randint(-1, 4 * rows, (rows,), generator=g),
                       torch.randint(0, 151936, (rows,), generator=g)]).to(DEVICE)  # (2, B): src, ids
    src, ids = buf[0], buf[1]
    src[0] = -1  # at least one host row
    got = feed_tokens(src, outputs.to(DEVICE), ids, backend="triton")
    want = feed_tokens_ref(src.cpu(), outputs, ids.cpu())
    assert got.dtype == torch.int64 and torch.equal(got.cpu(), want)
    assert torch.equal(want[src.cpu() < 0], ids.cpu()[src.cpu() < 0]) and want.max() < 2**24
