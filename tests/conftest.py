"""Shared pytest setup: markers, and tests/ on sys.path for the helpers."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

if not torch.cuda.is_available():  # Triton kernels run in the interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped without it")
    config.addinivalue_line("markers", "slow: long CPU test (a shortened training run)")


def pytest_collection_modifyitems(config, items):
    import pytest
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
