"""The in-order admission bound printed beside the ragged rollout benchmark (benchmarks/bench_rollout.py)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from bench_rollout import fifo_slot_bound  # noqa: E402


def test_fifo_slot_bound_exact():
    assert fifo_slot_bound([5] * 8, 4) == 1.0  # equal lengths, whole waves: no drain tail
    assert fifo_slot_bound([4, 1, 1, 1, 1], 2) == 1.0  # the short ones fill the other slot exactly
    assert fifo_slot_bound([3, 3, 3], 2) == pytest.approx(9 / 12)  # the third runs alone for 3 steps
    assert fifo_slot_bound([1, 1, 1, 10], 2) == pytest.approx(13 / 22)  # in order: the long one starts at step 1


def test_fifo_slot_bound_grows_with_waves():
    """Uniform 16..1024 on 128 slots: the benchmark's 4 waves cap near 78%, 8 waves near 87%."""
    import random

    rng = random.Random(0)
    four, eight = ([rng.randint(16, 1024) for _ in range(w * 128)] for w in (4, 8))
    assert 0.74 < fifo_slot_bound(four, 128) < 0.82 < fifo_slot_bound(eight, 128) < 0.90
