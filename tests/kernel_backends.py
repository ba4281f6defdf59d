"""What every kernel test shares: the device, and the backends to parametrize over.

Import it before ``megarl_kernels``: on CPU the Triton kernels run in the
interpreter, and TRITON_INTERPRET must be set before the kernels are built.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from megarl_kernels import triton_usable  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HAS_TRITON = triton_usable(torch.empty(0, device=DEVICE))
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton needs CUDA or TRITON_INTERPRET=1 before importing megarl_kernels")
BACKENDS = ["torch", pytest.param("triton", marks=needs_triton)]
