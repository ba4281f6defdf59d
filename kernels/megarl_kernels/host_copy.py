"""Copies between pinned host memory and the GPU as one kernel launch, no copy engine.

Spec (`copy_words_ref`). pairs: up to MAX_PAIRS (dst, src) tensors, each contiguous, the two
of a pair of one dtype and size; every dst[:] = src[:].

Why a kernel. The decode loop's step boundary was three asynchronous memcpys on the compute
stream (the sampled tokens out, the next step's inputs and block table in), and each one that
follows a kernel, or is followed by one, waits for the copy engine and back: the GPU idles at
every step boundary. Pinned host memory is mapped into the GPU's address space (CUDA's unified
addressing), so a kernel reads or writes it directly over the bus: the boundary becomes two small
kernel launches between the graphs (the gain: docs/performance.md). The kernel moves 32-bit words, so any dtype whose size
is a multiple of 4 bytes goes through (int64 inputs, int32 tables, fp32 tokens).

On the GPU the host side of a pair must be pinned (checked). Elsewhere (CPU tensors, or a CUDA
tensor paired with pageable memory) `copy_words` falls back to `Tensor.copy_`.
"""
import torch

from megarl_kernels.dispatch import HAS_TRITON, interpret_mode, tl, triton

MAX_PAIRS = 3
BLOCK = 2048  # 32-bit words per program (8 KiB); a decode step's inputs are 2-5 programs; not tuned


def copy_words_ref(pairs):
    """The spec: dst.copy_(src) for every pair."""
    for dst, src in pairs:
        dst.copy_(src)


@triton.jit
def _copy_block(dst, src, n, block, BLOCK: tl.constexpr):
    i = block * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + i, tl.load(src + i, mask=i < n), mask=i < n)


@triton.jit
def _copy_kernel(d0, s0, n0, d1, s1, n1, d2, s2, n2, BLOCK: tl.constexpr):
    """Programs [0, b0) copy pair 0, the next b1 pair 1, the rest pair 2 (b_i = cdiv(n_i, BLOCK))."""
    p = tl.program_id(0)
    b0, b1 = tl.cdiv(n0, BLOCK), tl.cdiv(n1, BLOCK)
    if p < b0:
        _copy_block(d0, s0, n0, p, BLOCK)
    elif p < b0 + b1:
        _copy_block(d1, s1, n1, p - b0, BLOCK)
    else:
        _copy_block(d2, s2, n2, p - b0 - b1, BLOCK)


def _words(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.int32)


def _check(pairs) -> None:
    if not 0 < len(pairs) <= MAX_PAIRS:
        raise ValueError(f"copy_words takes 1 to {MAX_PAIRS} (dst, src) pairs, got {len(pairs)}")
    for dst, src in pairs:
        if dst.dtype != src.dtype or dst.numel() != src.numel():
            raise ValueError(f"copy_words: a pair's dst and src differ: {dst.dtype} x {dst.numel()} vs "
                             f"{src.dtype} x {src.numel()}")
        if not (dst.is_contiguous() and src.is_contiguous()) or dst.element_size() % 4:
            raise ValueError("copy_words: each tensor must be contiguous with elements of 4 or 8 bytes")


def kernel_usable(pairs) -> bool:
    """The kernel can run on the GPU: some tensor is on CUDA and every other one is pinned."""
    tensors = [t for pair in pairs for t in pair]
    return HAS_TRITON and any(t.is_cuda for t in tensors) and all(t.is_cuda or t.is_pinned() for t in tensors)


def copy_words_triton(pairs) -> None:
    words = [(_words(d), _words(s)) for d, s in pairs if d.numel()]
    if not words:
        return
    args, grid = [], 0
    for i in range(MAX_PAIRS):
        dst, src = words[i] if i < len(words) else words[0]
        n = dst.numel() if i < len(words) else 0
        args += [dst, src, n]
        grid += triton.cdiv(n, BLOCK)
    _copy_kernel[(grid,)](*args, BLOCK=BLOCK, num_warps=4)


def copy_words(pairs, backend: str = "auto") -> None:
    """dst[:] = src[:] for each (dst, src) pair (module docstring), as one launch where
    `kernel_usable`, else `Tensor.copy_` (asynchronous where the memory allows). Stream-ordered like
    a kernel: a host buffer read or written here is free again once an event recorded after it
    completes. backend: "auto", "triton" or "torch"."""
    pairs = list(pairs)
    _check(pairs)
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"copy_words: backend={backend!r}; expected auto, triton or torch")
    on_gpu = kernel_usable(pairs)
    if backend == "triton" and not (on_gpu or (interpret_mode() and not any(d.is_cuda for d, _ in pairs))):
        raise RuntimeError("copy_words: backend='triton' needs CUDA tensors and pinned host tensors "
                           "(or CPU tensors under TRITON_INTERPRET=1)")
    if backend == "triton" or (backend == "auto" and on_gpu):
        copy_words_triton(pairs)
        return
    for dst, src in pairs:
        dst.copy_(src, non_blocking=True)
