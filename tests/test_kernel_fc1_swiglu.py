"""megarl_kernels.fc1_silu_mul: fc1 and SwiGLU in one kernel against the two-op spec.

The kernel takes bf16 / fp16 batches of up to MAX_ROWS rows with K a multiple of BLOCK_K; anything
else runs the spec's two ops. F need not divide into the kernel's column tiles (the last program's
columns past F are masked), so the CPU shapes use F = 200. On the GPU the kernel must give
F.linear + silu_mul's bits (the fp32 sums only change order); on CPU it runs in the interpreter,
which truncates each of its four fp32 -> bf16 roundings where the GPU rounds to nearest, so there
it is checked to four bf16 steps.
"""

import torch

from kernel_backends import DEVICE, needs_triton  # noqa: E402  (sets TRITON_INTERPRET first)

import pytest  # noqa: E402

from megarl_kernels import interpret_mode  # noqa: E402
from megarl_kernels.fc1_swiglu import (  # noqa: E402
    BLOCK_K, MAX_ROWS, TILES, fc1_silu_mul, fc1_silu_mul_ref, fc1_silu_mul_triton, fits_kernel,
)
from megarl_kernels.swiglu import silu_mul  # noqa: E402

pytestmark = needs_triton
SHAPE = (8960, 1536) if DEVICE == "cuda" else (200, 2 * BLOCK_K)  # (F, K): the 1.5B shape on the GPU


def _inputs(rows, f, k, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(2 * f, k, generator=g) * k ** -0.5).to(dtype).to(DEVICE)
    return x, w


def _check(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    if interpret_mode():
        torch.testing.assert_close(got.float(), want.float(), rtol=4 * 2 ** -7, atol=4 * 2 ** -7)
    else:
        equal = (got == want).float().mean().item()
        assert equal > 0.999, equal
        torch.testing.assert_close(got, want, rtol=2 ** -7, atol=2 ** -7)


@pytest.mark.parametrize("rows", [1, 5, 40, MAX_ROWS] + ([33, 100] if DEVICE == "cuda" else []))
def test_kernel_equals_the_spec(rows):
    x, w = _inputs(rows, *SHAPE)
    assert fits_kernel(x, w)
    _check(fc1_silu_mul(x, w, backend="triton"), fc1_silu_mul_ref(x, w))


@pytest.mark.parametrize("tiles", sorted(set(TILES.values())) + [(64, 8, 3, 4)])
def test_every_tile_equals_the_spec(tiles):
    """Each (BLOCK_N, TAIL, stages, warps) the table uses, and a tail of 8 (a 16-wide box, half stored)."""
    x, w = _inputs(24, *SHAPE, seed=1)
    _check(fc1_silu_mul_triton(x, w, tiles), fc1_silu_mul_ref(x, w))


# A shape the tile table was not tuned on (Qwen2.5-0.5B's fc1 on the GPU: F = 4,864 is no multiple of the
# 80-column programs, K = 896): the table's tile for each row count still gives the spec's result.
OTHER_SHAPE = (4864, 896) if DEVICE == "cuda" else (136, 3 * BLOCK_K)


@pytest.mark.parametrize("rows", [3, 17, 64, MAX_ROWS])
def test_table_tiles_on_another_shape(rows):
    x, w = _inputs(rows, *OTHER_SHAPE, seed=2)
    assert fits_kernel(x, w)
    _check(fc1_silu_mul(x, w, backend="triton"), fc1_silu_mul_ref(x, w))


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="the L2 prefetch is inline PTX: GPU only")
@pytest.mark.parametrize("steps", [0, 1, 2, 8])
def test_weights_asked_of_the_l2_change_no_bits(steps):
    """The prefetch before ``gdc_wait`` is a hint: every depth gives the same output as none."""
    x, w = _inputs(MAX_ROWS, *SHAPE, seed=2)
    want = fc1_silu_mul_triton(x, w, prefetch=0)
    assert torch.equal(fc1_silu_mul_triton(x, w, prefetch=steps), want)
    _check(want, fc1_silu_mul_ref(x, w))


@pytest.mark.parametrize("case", ["rows", "depth", "fp32", "strided"])
def test_outside_the_kernel_runs_the_two_ops(case):
    """More rows than MAX_ROWS, K not a multiple of BLOCK_K, fp32 (TF32 in the kernel), rows not
    dense: the op is F.linear then `silu_mul`, bit for bit."""
    rows = MAX_ROWS + 1 if case == "rows" else 3
    k = BLOCK_K + 8 if case == "depth" else BLOCK_K
    x, w = _inputs(rows, 24, k, torch.float32 if case == "fp32" else torch.bfloat16)
    if case == "strided":
        x = torch.cat([x, x], 1)[:, ::2]
    assert not fits_kernel(x, w)
    torch.testing.assert_close(fc1_silu_mul(x, w, backend="triton"),
                               silu_mul(torch.nn.functional.linear(x, w), backend="triton"), rtol=0, atol=0)


def test_cpu_default_is_the_spec():
    x, w = (t.cpu() for t in _inputs(3, 24, BLOCK_K))
    torch.testing.assert_close(fc1_silu_mul(x, w), fc1_silu_mul_ref(x, w), rtol=0, atol=0)


def test_bad_shapes_are_one_line_errors():
    x, w = _inputs(2, 24, BLOCK_K)
    with pytest.raises(ValueError, match="fc1_silu_mul: x"):
        fc1_silu_mul(x, w[:, :-1])
    with pytest.raises(ValueError, match="fc1_silu_mul: x"):
        fc1_silu_mul(x, w[:-1])


def test_no_tma_or_dependent_launch_off_hopper():
    """The kernel's TMA descriptors and its dependent launch need sm_90+: never chosen on CPU tensors
    outside the interpreter's tests, nor (by `fits_kernel`) on an older GPU."""
    from megarl_kernels.dispatch import hopper_or_newer

    assert not hopper_or_newer(torch.empty(1))
    if DEVICE == "cuda":
        assert hopper_or_newer(torch.empty(1, device="cuda")) == (torch.cuda.get_device_capability()[0] >= 9)
