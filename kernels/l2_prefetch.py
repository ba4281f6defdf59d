"""Asking the L2 for bytes a later kernel of the step will read: `prefetch.global.L2`, a hint that
brings nothing back to registers and never faults the caller.

Decode steps at small batches are weight streams with a few µs of fixed cost per kernel (the first
loads' latency, the tail): the weights never depend on the activations, so a kernel that runs while
HBM idles (an add + RMSNorm reads its inputs from the L2) can ask for the next linear's weights, and
the linear then finds them in the L2 (measured in benchmarks/RESULTS.md, session 25). GPU only: the
interpreter runs no inline assembly, so callers pass their PREFETCH switch as 0 there.
"""
from megarl.kernels.dispatch import tl, triton

LINE = 128  # bytes the L2 hands out per request


@triton.jit
def prefetch_l2(ptrs):
    """Ask the L2 for the 128-byte lines holding ptrs (any element type)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def prefetch_share(byte_ptr, n_lines, part, parts, BLOCK: tl.constexpr):
    """Program ``part`` of ``parts`` asks for its contiguous share of n_lines lines from byte_ptr
    (a uint8 pointer), BLOCK lines a round."""
    per = (n_lines + parts - 1) // parts
    first = part * per
    for c in range(0, per, BLOCK):
        line = tl.minimum(first + c + tl.arange(0, BLOCK), n_lines - 1).to(tl.int64)
        prefetch_l2(byte_ptr + line * 128)
