"""megarl_kernels.rope: the spec is megatron's RoPE op for op; Triton forward and backward equal it.

The spec (``rope_ref``) must give megatron-core's ``_apply_rotary_pos_emb_bshd`` bitwise (same ops);
the Triton kernels must give the spec's output and, through autograd, its gradient (fp32 to 1e-5, bf16 to
one rounding: on CUDA the compiler may contract a multiply-add), on odd head counts and per-sequence positions.
"""
from kernel_backends import DEVICE, needs_triton  # noqa: E402  (sets TRITON_INTERPRET first)

import pytest  # noqa: E402
import torch  # noqa: E402
from megatron.core.models.common.embeddings import rope_utils  # noqa: E402

from megarl_kernels.rope import rope, rope_ref, rope_tables  # noqa: E402

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


def _inputs(dtype, heads=3, d=16, total=11, table=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(total, heads, d, generator=g).to(dtype).to(DEVICE)
    half = torch.rand(table, d // 2, generator=g) * 6.0  # angles of D/2 frequencies, twice (megatron's table)
    freqs = torch.cat([half, half], -1).to(DEVICE)
    positions = torch.tensor([0, 1, 2, 3, 0, 1, 0, 1, 2, 3, 4][:total] + [5] * max(0, total - 11)).to(DEVICE)
    return t, positions, freqs, rope_tables(freqs, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_spec_is_megatrons_rope_bitwise(dtype):
    t, positions, freqs, tables = _inputs(dtype)
    want = rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), freqs[positions][:, None, None, :]).squeeze(1)
    assert torch.equal(rope_ref(t, positions, *tables), want)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,d", [(3, 16), (12, 32)])
def test_triton_forward_and_backward_equal_the_spec(dtype, heads, d):
    t, positions, _, tables = _inputs(dtype, heads, d)
    x = t.clone().requires_grad_()
    x_ref = t.clone().requires_grad_()
    dout = torch.randn(t.shape, generator=torch.Generator().manual_seed(9)).to(dtype).to(DEVICE)
    out = rope(x, positions, *tables, backend="triton")
    out.backward(dout)
    out_ref = rope_ref(x_ref, positions, *tables)
    out_ref.backward(dout)
    torch.testing.assert_close(out, out_ref, **TOL[dtype])
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL[dtype])
    assert not torch.equal(out_ref, t)


def test_shapes_are_checked():
    t, positions, _, tables = _inputs(torch.float32)
    with pytest.raises(ValueError, match="rope: want"):
        rope(t, positions[:-1], *tables)
