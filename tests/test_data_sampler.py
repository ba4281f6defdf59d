"""PromptSampler: DP shards, determinism, resume, epoch boundary (drop_last)."""
from __future__ import annotations

import pytest

from megarl.data import PromptSampler


def take(sampler: PromptSampler, steps: int) -> list[list[int]]:
    return [next(sampler) for _ in range(steps)]


def test_dp_shards_disjoint_and_cover_global_batch():
    """Rank r's slice of step k is global[k][r*B:(r+1)*B]; slices are disjoint."""
    n, b, dp = 50, 3, 4
    ref = PromptSampler(n, b, dp_size=dp, seed=7)
    ranks = [PromptSampler(n, b, dp_rank=r, dp_size=dp, seed=7) for r in range(dp)]
    for _ in range(9):  # crosses epochs: 50 // 12 = 4 steps per epoch
        glob = ref.next_global()
        parts = [next(s) for s in ranks]
        assert sum(parts, []) == glob
        assert len(set(glob)) == b * dp and all(len(p) == b for p in parts)


def test_deterministic_per_seed():
    assert take(PromptSampler(40, 4, seed=1), 12) == take(PromptSampler(40, 4, seed=1), 12)
    assert take(PromptSampler(40, 4, seed=1), 12) != take(PromptSampler(40, 4, seed=2), 12)


def test_epochs_reshuffle_and_drop_last():
    """N=10, B_global=4: 2 steps per epoch, 8 distinct indices, the last 2 of the permutation dropped."""
    s = PromptSampler(10, 2, dp_size=2, seed=3)
    assert s.steps_per_epoch == 2
    epochs = []
    for e in range(3):
        got = [s.next_global() for _ in range(2)]
        assert s.epoch == e
        flat = sum(got, [])
        assert len(set(flat)) == 8 and flat == s.permutation(e)[:8].tolist()
        epochs.append(flat)
    assert epochs[0] != epochs[1]
    s.next_global()
    assert (s.epoch, s.offset) == (3, 4)


def test_no_shuffle_is_in_order():
    s = PromptSampler(5, 2, shuffle=False)
    assert take(s, 3) == [[0, 1], [2, 3], [0, 1]]


@pytest.mark.parametrize("stop", [0, 1, 4, 5, 7])
def test_resume_equals_uninterrupted(stop):
    """Resuming a fresh sampler from state_dict after `stop` steps gives the same tail."""
    n, b, dp, rank = 23, 2, 3, 1  # 3 steps per epoch, 5 dropped each epoch
    full = take(PromptSampler(n, b, rank, dp, seed=11), 12)
    first = PromptSampler(n, b, rank, dp, seed=11)
    take(first, stop)
    resumed = PromptSampler(n, b, rank, dp, seed=11)
    resumed.load_state_dict(dict(first.state_dict()))
    assert take(resumed, 12 - stop) == full[stop:]


def test_next_batch_tags_epoch_and_step():
    class DS:
        def batch(self, indices, epoch, step):
            return (indices, epoch, step)
    s = PromptSampler(6, 3, seed=0)  # 2 steps per epoch
    got = [s.next_batch(DS())[1:] for _ in range(5)]
    assert got == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]


def test_errors():
    with pytest.raises(ValueError, match="fewer than one global batch"):
        PromptSampler(5, 3, dp_size=2)
    with pytest.raises(ValueError, match="dp_rank=2 not in"):
        PromptSampler(50, 3, dp_rank=2, dp_size=2)
    s = PromptSampler(50, 3, seed=1)
    with pytest.raises(ValueError, match="checkpoint has seed=2"):
        s.load_state_dict({**s.state_dict(), "seed": 2})
