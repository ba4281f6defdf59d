"""megarl_kernels.copy_words: one launch copying (dst, src) pairs of 32-bit words, the graphs' step boundary.

On CPU the kernel runs in the interpreter on CPU tensors; on the GPU (marked gpu) it reads and writes
pinned host memory directly, in both directions, as the decode graphs use it.
"""
import torch

from kernel_backends import DEVICE, needs_triton  # noqa: E402  (sets TRITON_INTERPRET first)

import pytest  # noqa: E402

from megarl_kernels.host_copy import BLOCK, copy_words, copy_words_ref, kernel_usable  # noqa: E402


def _pairs(device, host_pinned=False):
    """Three pairs as a decode step has them: (7, B) int64 rows, a (B, pages) int32 table with a size
    that is not a multiple of BLOCK and spans two programs, and (2, W) fp32 tokens; the sources pinned
    (``host_pinned``) or on ``device``."""
    g = torch.Generator().manual_seed(0)
    srcs = [torch.randint(-2**40, 2**40, (7, 300), generator=g),
            torch.randint(-1, 2**31 - 1, (97, 23), generator=g, dtype=torch.int64).int(),
            torch.randn(2, 256, generator=g)]
    assert srcs[1].numel() > BLOCK
    host = [s.pin_memory() if host_pinned else s.to(device) for s in srcs]  # on CUDA: pinned, or on the device
    return [(torch.full_like(s, -7, device=device), h) for s, h in zip(srcs, host)]


@needs_triton
@pytest.mark.parametrize("n_pairs", [1, 2, 3])
def test_copy_words_kernel(n_pairs):
    """Every word of each pair lands; nothing is written past a pair's end (its neighbour's slice of
    the grid copies its own pair)."""
    pairs = _pairs(DEVICE)[:n_pairs]
    copy_words(pairs, backend="triton")
    for dst, src in pairs:
        assert dst.dtype == src.dtype and torch.equal(dst.cpu(), src.cpu())


@needs_triton
def test_copy_words_empty_pair_and_views():
    """An empty pair launches nothing for it; a row slice of a wider buffer (the table's [:b]) is
    contiguous and copies only its rows."""
    big = torch.zeros(8, 40, dtype=torch.int32, device=DEVICE)
    src = torch.arange(3 * 40, dtype=torch.int32).view(3, 40).to(DEVICE)
    copy_words([(big[:3], src), (big[3:3], src[:0])], backend="triton")
    assert torch.equal(big[:3], src) and not big[3:].any()


def test_copy_words_rejects_mismatched_pairs():
    a = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="differ"):
        copy_words([(a, torch.zeros(4, dtype=torch.int32))])
    with pytest.raises(ValueError, match="contiguous"):
        copy_words([(torch.zeros(4, 4)[:, :2], torch.zeros(4, 2))])
    with pytest.raises(ValueError, match="4 or 8 bytes"):
        copy_words([(torch.zeros(4, dtype=torch.int16), torch.zeros(4, dtype=torch.int16))])
    with pytest.raises(ValueError, match="1 to 3"):
        copy_words([(a, a)] * 4)


def test_copy_words_cpu_falls_back_to_copy():
    pairs = _pairs("cpu")
    copy_words(pairs)  # auto on CPU: Tensor.copy_
    for dst, src in pairs:
        assert torch.equal(dst, src)
    copy_words_ref([(pairs[0][0].zero_(), pairs[0][1])])
    assert torch.equal(pairs[0][0], pairs[0][1])


@pytest.mark.gpu
def test_copy_words_pinned_both_ways():
    """GPU: pinned host -> device and device -> pinned host in one launch each; pageable host memory
    is not kernel-usable (auto falls back to copy_, 'triton' refuses)."""
    pairs = _pairs("cuda", host_pinned=True)
    assert kernel_usable(pairs)
    copy_words(pairs)  # host -> device, the kernel
    back = [(torch.empty_like(h).pin_memory(), d) for d, h in pairs]
    copy_words(back)  # device -> host, the kernel
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    for (dst, _), (_, h) in zip(back, pairs):
        assert torch.equal(dst, h)
    pageable = [(pairs[0][0], pairs[0][1].clone())]
    assert not kernel_usable(pageable)
    with pytest.raises(RuntimeError, match="pinned"):
        copy_words(pageable, backend="triton")
    copy_words(pageable)
    torch.cuda.synchronize()
    assert torch.equal(pairs[0][0].cpu(), pageable[0][1])
