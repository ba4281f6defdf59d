"""Split-K linears of the decode step (megarl.rollout.split_linear): partial sums and the split choice.

The partials of every split must add up to ``F.linear`` (fp32, to summation order); on CUDA the
bf16 inputs give fp32 partials whose rounded sum is within one bf16 step of cuBLAS's own output.
The engine-level check (greedy tokens and training log-probs with the split on) is in
tests/test_rollout_native.py.
"""
import pytest
import torch
import torch.nn.functional as F

from megarl_kernels.rms_norm import sum_parts_ref
from megarl.rollout.graphs import BUCKETS
from megarl.rollout.split_linear import SPLITS, split_k_linear, split_parts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 6])
def test_partials_add_up_to_the_linear(parts):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 48, generator=g), torch.randn(20, 48, generator=g)
    out = split_k_linear(x.to(DEVICE), w.to(DEVICE), parts)
    assert out.shape == (parts, 5, 20) and out.dtype == torch.float32
    torch.testing.assert_close(sum_parts_ref(out, torch.float32).cpu(), F.linear(x, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[0].cpu(), F.linear(x[:, : 48 // parts], w[:, : 48 // parts]), rtol=1e-5, atol=1e-5)


def test_an_uneven_split_is_refused():
    with pytest.raises(ValueError, match="K = 10 .* 3 equal slices"):
        split_k_linear(torch.zeros(2, 10), torch.zeros(4, 10), 3)


def test_the_split_reads_the_weight_in_place():
    w = torch.randn(8, 16)
    before = split_k_linear(torch.eye(16)[:1], w, 2)
    w.mul_(2)  # an optimizer step: the next call sees it, no stale copy anywhere
    torch.testing.assert_close(split_k_linear(torch.eye(16)[:1], w, 2), 2 * before)


@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 -> fp32 bmm is CUDA only")
def test_bf16_partials_match_cublas_to_one_rounding():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(128, 8960, generator=g).bfloat16().cuda()
    w = (torch.randn(1536, 8960, generator=g) * 0.02).bfloat16().cuda()
    ref = F.linear(x, w)
    for parts in (2, 4, 5):
        got = sum_parts_ref(split_k_linear(x, w, parts), torch.bfloat16)
        torch.testing.assert_close(got.float(), ref.float(), rtol=1.6e-2, atol=1e-2)


def test_split_choice():
    fc2 = [split_parts("fc2", m, 8960) for m in (1, 32, 64, 96, 128, 256, 320, 512, 640)]
    assert fc2 == [2, 2, 2, 4, 4, 4, 2, 2, 1]
    assert [split_parts("proj", m, 1536) for m in (1, 128, 160, 256, 320)] == [3, 3, 2, 2, 1]
    assert split_parts("proj", 32, 64) == 2  # 3 does not divide 64: the next smaller that does
    assert split_parts("fc2", 128, 20) == 1  # no split into slices of a multiple of 8
    assert [split_parts("qkv", m, 1536) for m in (32, 64, 96, 128, 160)] == [4, 4, 3, 3, 1]
    assert split_parts("logits", 32, 1536) == 1  # no table: never split
    for table in SPLITS.values():  # an eager batch and its padded graph choose the same S
        assert all(limit in BUCKETS for limit, _ in table)


@pytest.mark.parametrize("hidden,ffn", [(4096, 11008), (896, 4864)])  # Llama-2-7B, Qwen2.5-0.5B: not the tuned shape
def test_split_choice_on_another_shape(hidden, ffn):
    """The table was tuned on the 1.5B shape; on another one every chosen S is at most the table's, splits K
    into equal 8-aligned slices, and its partials add up to F.linear (fp32, to summation order)."""
    g = torch.Generator().manual_seed(2)
    for name, k, n in (("fc2", ffn, hidden), ("proj", hidden, hidden), ("qkv", hidden, hidden + 256)):
        for rows in (1, 32, 64, 128, 256, 512):
            parts = split_parts(name, rows, k)
            want = next((s for limit, s in SPLITS[name] if rows <= limit), 1)
            assert 1 <= parts <= want and k % parts == 0 and (k // parts) % 8 == 0, (name, rows, k, parts)
        x, w = torch.randn(16, k, generator=g), torch.randn(n, k, generator=g) / k ** 0.5
        parts = split_parts(name, 16, k)
        got = sum_parts_ref(split_k_linear(x.to(DEVICE), w.to(DEVICE), parts), torch.float32).cpu()
        torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert split_parts("proj", 128, 896) == 2  # 3 does not divide 896: 2 (448-wide slices)
    assert split_parts("fc2", 128, 11008) == 4  # 11008 / 4 = 2752, a multiple of 8
