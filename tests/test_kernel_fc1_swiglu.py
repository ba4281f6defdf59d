"""megarl.kernels.fc1_silu_mul: fc1 and SwiGLU in one kernel against the two-op spec.

The kernel takes bf16 / fp16 batches of up to MAX_ROWS rows whose shapes its tiles divide; anything
else runs the spec's two ops. On the GPU the kernel must give F.linear + silu_mul's bits (the fp32
sums only change order); on CPU it runs in the interpreter, which truncates each of its four
fp32 -> bf16 roundings where the GPU rounds to nearest, so there it is checked to four bf16 steps.
"""

import torch

from kernel_backends import DEVICE, needs_triton  # noqa: E402  (sets TRITON_INTERPRET first)

import pytest  # noqa: E402

from megarl.kernels import interpret_mode  # noqa: E402
from megarl.kernels.fc1_swiglu import BLOCK_K, BLOCK_N, MAX_ROWS, fc1_silu_mul, fc1_silu_mul_ref, fits_kernel  # noqa: E402
from megarl.kernels.swiglu import silu_mul  # noqa: E402

pytestmark = needs_triton


def _inputs(rows, f, k, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(2 * f, k, generator=g) * k ** -0.5).to(dtype).to(DEVICE)
    return x, w


@pytest.mark.parametrize("rows", [1, 5, MAX_ROWS] + ([33] if DEVICE == "cuda" else []))
def test_kernel_equals_the_spec(rows):
    f, k = (8960, 1536) if DEVICE == "cuda" else (2 * BLOCK_N, 2 * BLOCK_K)  # the 1.5B shape on the GPU
    x, w = _inputs(rows, f, k)
    assert fits_kernel(x, w)
    got, want = fc1_silu_mul(x, w, backend="triton"), fc1_silu_mul_ref(x, w)
    assert got.shape == (rows, f) and got.dtype == x.dtype
    if interpret_mode():
        torch.testing.assert_close(got.float(), want.float(), rtol=4 * 2 ** -7, atol=4 * 2 ** -7)
    else:
        equal = (got == want).float().mean().item()
        assert equal > 0.999, equal
        torch.testing.assert_close(got, want, rtol=2 ** -7, atol=2 ** -7)


@pytest.mark.parametrize("case", ["rows", "columns", "fp32", "strided"])
def test_outside_the_tiles_runs_the_two_ops(case):
    """More rows than MAX_ROWS, F not a multiple of BLOCK_N, fp32 (TF32 in the kernel), rows not
    dense: the op is F.linear then `silu_mul`, bit for bit."""
    rows, f, k = (MAX_ROWS + 1, BLOCK_N, BLOCK_K) if case == "rows" else (3, BLOCK_N + 8 if case == "columns" else BLOCK_N, BLOCK_K)
    x, w = _inputs(rows, f, k, torch.float32 if case == "fp32" else torch.bfloat16)
    if case == "strided":
        x = torch.cat([x, x], 1)[:, ::2]
    assert not fits_kernel(x, w)
    torch.testing.assert_close(fc1_silu_mul(x, w, backend="triton"),
                               silu_mul(torch.nn.functional.linear(x, w), backend="triton"), rtol=0, atol=0)


def test_cpu_default_is_the_spec():
    x, w = (t.cpu() for t in _inputs(3, BLOCK_N, BLOCK_K))
    torch.testing.assert_close(fc1_silu_mul(x, w), fc1_silu_mul_ref(x, w), rtol=0, atol=0)


def test_bad_shapes_are_one_line_errors():
    x, w = _inputs(2, BLOCK_N, BLOCK_K)
    with pytest.raises(ValueError, match="fc1_silu_mul: x"):
        fc1_silu_mul(x, w[:, :-1])
    with pytest.raises(ValueError, match="fc1_silu_mul: x"):
        fc1_silu_mul(x, w[:-1])
