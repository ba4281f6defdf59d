"""Backend choice shared by every op in `megarl_kernels`.

Each public op takes `backend=`:
    "auto"   Triton when every tensor is on CUDA (and Triton imports), else "torch"
    "triton" the Triton kernels; on CPU only under TRITON_INTERPRET=1 (tests)
    "torch"  a vectorized PyTorch version (CPU fallback, no Python loop over T/V)
    "ref"    the `<op>_ref` spec (slow, for tests and benchmarks)

TRITON_INTERPRET is read by `triton.jit` when a kernel module is imported, so it
must be in the environment before `megarl_kernels` is first imported.
"""
from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "triton", "torch", "ref")

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    HAS_TRITON = True
except ImportError:  # CPU installs without triton: torch/ref only; kernels stay undefined stubs
    HAS_TRITON = False

    class _NoTriton:
        """Stands in for `triton` and `triton.language` so kernel modules import."""

        constexpr = object

        @staticmethod
        def jit(fn=None, **_):
            return fn if fn is not None else (lambda f: f)

    triton = tl = libdevice = _NoTriton()


@triton.jit
def _probe_kernel(x):
    # never launched: built like every kernel module's kernels, it tells how they were built
    pass


def interpret_mode() -> bool:
    """Whether the Triton kernels were built for the CPU interpreter."""
    if not HAS_TRITON:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_probe_kernel, InterpretedFunction)


def triton_usable(*tensors: torch.Tensor) -> bool:
    """True if the Triton path can run on these tensors right now."""
    if not HAS_TRITON:
        return False
    if all(t.is_cuda for t in tensors):
        return True
    return all(t.device.type == "cpu" for t in tensors) and interpret_mode()


def choose(backend: str, *tensors: torch.Tensor) -> str:
    """Resolve `backend` to "triton", "torch" or "ref" for these tensors."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        cuda = HAS_TRITON and len(tensors) > 0 and all(t.is_cuda for t in tensors)
        return "triton" if cuda else "torch"
    if backend == "triton" and not triton_usable(*tensors):
        why = "triton is not installed" if not HAS_TRITON else (
            "tensors are not on CUDA; on CPU set TRITON_INTERPRET=1 before importing megarl_kernels"
            f" (now TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r})")
        raise RuntimeError(f"backend='triton' unavailable: {why}")
    return backend


def hopper_or_newer(t: torch.Tensor) -> bool:
    """Whether ``t``'s GPU has TMA and programmatic dependent launch (sm_90+); False on CPU."""
    return t.is_cuda and torch.cuda.get_device_capability(t.device)[0] >= 9


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()
