"""pack_sequences (first-fit-decreasing) and packed THD inputs."""
from __future__ import annotations

import random

import pytest
import torch

from megarl.data import build_packed_inputs, pack_sequences, unpack


def check_bins(bins, lengths, max_tokens):
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= max_tokens for b in bins)


def test_pack_small_example_exact():
    """FFD on [5,4,3,3,2,1] with budget 8 gives 5+3 | 4+3+1 | 2."""
    lengths = [5, 4, 3, 3, 2, 1]
    bins = pack_sequences(lengths, 8)
    # sorted: 0(5) 1(4) 2(3) 3(3) 4(2) 5(1)
    # 0 -> bin0 [5]; 1 -> bin1 [4]; 2 -> bin0 [5+3=8]; 3 -> bin1 [4+3=7];
    # 4 -> bin2 [2]; 5 -> bin1 [7+1=8]
    assert bins == [[0, 2], [1, 3, 5], [4]]


def test_pack_random_respects_budget_and_covers():
    rng = random.Random(0)
    for _ in range(50):
        lengths = [rng.randint(0, 100) for _ in range(rng.randint(1, 40))]
        budget = rng.randint(100, 400)
        check_bins(pack_sequences(lengths, budget), lengths, budget)


def test_pack_min_bins_and_errors():
    lengths = [3, 3, 2, 2, 1]
    bins = pack_sequences(lengths, 100, min_bins=3)
    assert len(bins) == 3
    check_bins(bins, lengths, 100)
    with pytest.raises(ValueError, match="min_bins=6"):
        pack_sequences(lengths, 100, min_bins=6)
    with pytest.raises(ValueError, match="sequence 1 has 9 tokens"):
        pack_sequences([1, 9], 8)


def test_build_packed_inputs_exact():
    p = build_packed_inputs([[5, 6, 7], [8], [9, 10]])
    assert p.input_ids.tolist() == [[5, 6, 7, 8, 9, 10]]
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert p.cu_seqlens.dtype == torch.int32 and p.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert p.max_seqlen == 3 and p.num_sequences == 3
    assert [t.tolist() for t in unpack(p.input_ids, p.cu_seqlens)] == [[5, 6, 7], [8], [9, 10]]
    logits = torch.randn(1, 6, 4)  # (1, T, V)
    parts = unpack(logits, p.cu_seqlens)
    assert [t.shape for t in parts] == [(3, 4), (1, 4), (2, 4)]
    with pytest.raises(ValueError, match="cu_seqlens ends at 6"):
        unpack(torch.zeros(5), p.cu_seqlens)
