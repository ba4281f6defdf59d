"""megarl.kernels decode_linear / decode_swiglu: Triton against F.linear (+ silu_mul) on odd shapes.

Rows 1, 5 and 37 (not multiples of the row tile), K not a multiple of the K
tile, N not a multiple of the column tile, with and without bias, one split
and several (the fp32 partials and the ordered reduction), fp32 and bf16.
fp32 agrees to summation order (1e-5); bf16 to one rounding of the output.
"""
import torch

from kernel_backends import DEVICE, needs_triton  # noqa: E402  (sets TRITON_INTERPRET first)

import pytest  # noqa: E402

from megarl.kernels.decode_linear import (  # noqa: E402
    GemmConfig, decode_linear, decode_linear_ref, decode_swiglu, decode_swiglu_ref, gemm_config)

pytestmark = needs_triton
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=2e-2)}
SMALL = dict(block_n=16, block_k=32, num_warps=4, num_stages=2)


def _rand(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,splits,bias", [(1, 48, 96, 1, False), (5, 40, 100, 3, True), (37, 64, 160, 2, True)])
def test_decode_linear(dtype, m, n, k, splits, bias):
    x = _rand(m, k, dtype=dtype, seed=1)
    w = _rand(n, k, dtype=dtype, seed=2, scale=k ** -0.5)
    b = _rand(n, dtype=dtype, seed=3) if bias else None
    cfg = GemmConfig(block_m=16, splits=splits, **SMALL)
    out = decode_linear(x, w, b, backend="triton", config=cfg)
    assert out.shape == (m, n) and out.dtype == dtype
    torch.testing.assert_close(out, decode_linear_ref(x, w, b), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,f,k,splits", [(3, 24, 64, 1), (17, 40, 96, 3)])
def test_decode_swiglu(dtype, m, f, k, splits):
    x = _rand(m, k, dtype=dtype, seed=4)
    w = _rand(2 * f, k, dtype=dtype, seed=5, scale=k ** -0.5)
    cfg = GemmConfig(block_m=16, splits=splits, **SMALL)
    out = decode_swiglu(x, w, backend="triton", config=cfg)
    assert out.shape == (m, f) and out.dtype == dtype
    # bf16: four roundings (gate, up, silu, product), each one step apart at most (the CPU
    # interpreter truncates where the GPU rounds to nearest)
    tol = TOL[dtype] if dtype == torch.float32 else dict(rtol=3.2e-2, atol=2e-2)
    torch.testing.assert_close(out, decode_swiglu_ref(x, w), **tol)


def test_splits_are_deterministic_and_equal_one_split_in_fp32():
    x = _rand(9, 128, dtype=torch.float32, seed=6)
    w = _rand(32, 128, dtype=torch.float32, seed=7)
    one = decode_linear(x, w, backend="triton", config=GemmConfig(block_m=16, splits=1, **SMALL))
    four = decode_linear(x, w, backend="triton", config=GemmConfig(block_m=16, splits=4, **SMALL))
    again = decode_linear(x, w, backend="triton", config=GemmConfig(block_m=16, splits=4, **SMALL))
    assert torch.equal(four, again)  # ordered reduction: the same bits every call
    torch.testing.assert_close(one, four, rtol=1e-5, atol=1e-5)


def test_config_from_shapes_fills_the_machine():
    cfg = gemm_config(128, 2048, 1536, torch.device("cpu"), block_n=64, block_k=128, programs_per_sm=2)
    assert cfg.block_m == 128 and cfg.splits == 1  # 32 tiles >= 2 * 4 stand-in SMs
    cfg = gemm_config(16, 64, 8960, torch.device("cpu"), block_n=64, block_k=128, programs_per_sm=2)
    assert cfg.block_m == 16 and cfg.splits == 8  # 1 tile: 8 programs wanted, 70 K tiles allow it


def test_auto_on_cpu_is_the_reference_and_bad_shapes_say_so():
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    assert torch.equal(decode_linear(x, w, backend="torch"), decode_linear_ref(x, w))
    with pytest.raises(ValueError, match=r"want x \(M, K\) and w \(N, K\)"):
        decode_linear(x, torch.randn(6, 9))
    with pytest.raises(ValueError, match="2F rows"):
        decode_swiglu(x, torch.randn(7, 8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="programmatic dependent launch needs CUDA")
def test_dependent_launch_in_a_graph_gives_the_same_bits():
    from megarl.kernels.dispatch import pdl_usable
    from megarl.kernels.rms_norm import add_rms_norm_triton

    if not pdl_usable(torch.device("cuda")):
        pytest.skip("no PDL here (pre-Hopper GPU, old Triton or MEGARL_PDL=0)")
    x = _rand(64, 512, dtype=torch.bfloat16, seed=8)
    w1 = _rand(1024, 512, dtype=torch.bfloat16, seed=9, scale=512 ** -0.5)
    w2 = _rand(512, 512, dtype=torch.bfloat16, seed=10, scale=512 ** -0.5)
    norm = torch.ones(512, device="cuda")
    cfg = GemmConfig(block_m=64, block_n=32, block_k=128, splits=2, num_warps=4, num_stages=3)

    def chain(pdl):
        h, _ = add_rms_norm_triton(x, None, norm, 1e-6, pdl=pdl)
        return decode_linear(decode_swiglu(h, w1, backend="triton", config=cfg, pdl=pdl), w2, backend="triton",
                             config=cfg, pdl=pdl)

    eager = chain(False)
    graph, static = torch.cuda.CUDAGraph(), None
    chain(True)  # compile outside the capture
    with torch.cuda.graph(graph):
        static = chain(True)
    for _ in range(3):
        graph.replay()
        assert torch.equal(static, eager)
