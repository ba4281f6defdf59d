"""Advantage estimators against hand-computed values (float64, tiny batches)."""
import math

import pytest
import torch

from megarl.algos.advantages import AdvantageConfig, AdvantageInputs, get_advantage
from megarl.algos.returns import discounted_returns, gae_advantages, group_normalized_scores

D = torch.float64


def t(x):
    return torch.tensor(x, dtype=D)


def test_gae_skips_masked_positions():
    """gamma = lam = 0.5.

    Row 0, all real, r = [0, 0, 1], V = [0.5, 0.25, 0.5]:
      t2: delta = 1 - 0.5 = 0.5,                 A = 0.5
      t1: delta = 0 + 0.5*0.5 - 0.25 = 0,         A = 0 + 0.25*0.5 = 0.125
      t0: delta = 0 + 0.5*0.25 - 0.5 = -0.375,    A = -0.375 + 0.25*0.125 = -0.34375
      returns = A + V = [0.15625, 0.375, 1.0]
    Row 1, mask [1, 0, 1, 0] (a skipped token inside, padding after), r = [0, 9, 1, 7],
    V = [0.5, 100, 0.5, 100]; the 9/7/100 must not leak:
      t2: delta = 1 - 0.5 = 0.5, A = 0.5; t0 bootstraps from t2:
      t0: delta = 0 + 0.5*0.5 - 0.5 = -0.25, A = -0.25 + 0.25*0.5 = -0.125
      returns = [0.375, 0, 1.0, 0]
    """
    adv, ret = gae_advantages(t([[0, 0, 1.0]]), t([[0.5, 0.25, 0.5]]), t([[1, 1, 1.0]]), 0.5, 0.5)
    torch.testing.assert_close(adv, t([[-0.34375, 0.125, 0.5]]))
    torch.testing.assert_close(ret, t([[0.15625, 0.375, 1.0]]))
    adv, ret = gae_advantages(t([[0, 9, 1, 7.0]]), t([[0.5, 100, 0.5, 100]]), t([[1, 0, 1, 0.0]]), 0.5, 0.5)
    torch.testing.assert_close(adv, t([[-0.125, 0, 0.5, 0]]))
    torch.testing.assert_close(ret, t([[0.375, 0, 1.0, 0]]))


def test_gae_estimator_whitens_advantages_not_returns():
    """Row 1 of the test above alone: real advantages -0.125 and 0.5, mean 0.1875,
    deviations -/+0.3125, unbiased var 2 * 0.3125^2 / 1, so whitened values are
    -/+0.3125 / sqrt(0.1953125 + 1e-8) ~ -/+1/sqrt(2); returns stay un-whitened."""
    batch = AdvantageInputs(t([[0, 9, 1, 7.0]]), t([[1, 0, 1, 0.0]]), values=t([[0.5, 100, 0.5, 100]]))
    adv, ret = get_advantage("gae")(batch, AdvantageConfig(gamma=0.5, lam=0.5))
    w = 0.3125 / math.sqrt(2 * 0.3125**2 + 1e-8)
    torch.testing.assert_close(adv, t([[-w, 0, w, 0]]))
    torch.testing.assert_close(ret, t([[0.375, 0, 1.0, 0]]))


SCORES = [1.0, 0.0, 0.0, 3.0, 5.0, 7.0]
GROUPS = [0, 1, 0, 2, 1, 1]  # not contiguous; group 2 has one sample


def test_group_modes():
    """Group 0 = {1, 0}: mean 0.5, unbiased std sqrt(0.5); group 1 = {0, 5, 7}:
    mean 4, deviations -4, 1, 3, unbiased var 26/2 = 13; group 2 = {3}: 0.
    rloo = n/(n-1) * (s - mean): group 0 -> +-1 (1 - 0, 0 - 1); group 1 ->
    1.5 * [-4, 1, 3] = [-6, 1.5, 4.5] (e.g. 0 - mean(5, 7) = -6)."""
    s, g = t(SCORES), torch.tensor(GROUPS)
    a, b = math.sqrt(0.5) + 1e-6, math.sqrt(13) + 1e-6
    torch.testing.assert_close(group_normalized_scores(s, g, "std"), t([0.5 / a, -4 / b, -0.5 / a, 0, 1 / b, 3 / b]))
    torch.testing.assert_close(group_normalized_scores(s, g, "mean"), t([0.5, -4, -0.5, 0, 1, 3]))
    torch.testing.assert_close(group_normalized_scores(s, g, "rloo"), t([1, -6, -1, 0, 1.5, 4.5]))


def test_grpo_drgrpo_rloo_broadcast_over_mask():
    """Sequence advantages from test_group_modes times the mask; returns = advantages.
    Scores come from token_rewards' masked sum when batch.scores is None."""
    mask = t([[1, 1], [1, 0], [1, 1], [0, 0], [1, 1], [1, 0]])
    token_rewards = torch.zeros(6, 2, dtype=D)
    token_rewards[:, 0] = t(SCORES)
    batch = AdvantageInputs(token_rewards, mask, group_ids=torch.tensor(GROUPS))
    adv, ret = get_advantage("grpo")(batch, AdvantageConfig(norm_by_std=False))
    torch.testing.assert_close(adv, t([0.5, -4, -0.5, 0, 1, 3])[:, None] * mask)
    assert adv is ret or torch.equal(adv, ret)
    adv, _ = get_advantage("rloo")(batch, AdvantageConfig())
    torch.testing.assert_close(adv, t([1, -6, -1, 0, 1.5, 4.5])[:, None] * mask)
    adv, _ = get_advantage("grpo")(batch, AdvantageConfig())
    expected = group_normalized_scores(t(SCORES), torch.tensor(GROUPS), "std")
    torch.testing.assert_close(adv, expected[:, None] * mask)


def test_reinforce_pp():
    """gamma 0.5. Row 0 r = [0, 0, 1] -> G = [0.25, 0.5, 1]; row 1 r = [0, 2, x]
    with the last masked -> G = [1, 2, 0]. Whitening over {0.25, 0.5, 1, 1, 2}:
    mean 0.95, deviations -0.7, -0.45, 0.05, 0.05, 1.05, squares sum 1.8,
    unbiased var 1.8 / 4 = 0.45."""
    batch = AdvantageInputs(t([[0, 0, 1], [0, 2, 5]]), t([[1, 1, 1], [1, 1, 0]]))
    adv, ret = get_advantage("reinforce_pp")(batch, AdvantageConfig(gamma=0.5))
    torch.testing.assert_close(ret, t([[0.25, 0.5, 1], [1, 2, 0]]))
    std = math.sqrt(0.45 + 1e-8)
    torch.testing.assert_close(adv, t([[-0.7, -0.45, 0.05], [0.05, 1.05, 0]]) / std)
    adv, _ = get_advantage("reinforce_pp")(batch, AdvantageConfig(gamma=0.5, whiten=False))
    torch.testing.assert_close(adv, ret)


def test_reinforce_pp_baseline():
    """gamma 1, scores [1, 0, 3, 1] on the last real token, groups [0, 0, 1, 1]
    (means 0.5 and 2), row 3 has one real token. Return-to-go minus the group
    mean: [0.5, 0.5], [-0.5, -0.5], [1, 1], [-1, masked]. Whitening over those 7
    values: mean 1/7, sum of squares 4, so sum((v - mean)^2) = 4 - 7/49 = 27/7,
    unbiased var 27/7 / 6 = 9/14."""
    mask = t([[1, 1], [1, 1], [1, 1], [1, 0]])
    rewards = t([[0, 1], [0, 0], [0, 3], [1, 0]])
    batch = AdvantageInputs(rewards, mask, scores=t([1, 0, 3, 1]), group_ids=torch.tensor([0, 0, 1, 1]))
    raw = t([[0.5, 0.5], [-0.5, -0.5], [1, 1], [-1, 0]])
    adv, ret = get_advantage("reinforce_pp_baseline")(batch, AdvantageConfig(whiten=False))
    torch.testing.assert_close(adv, raw)
    torch.testing.assert_close(ret, t([[1, 1], [0, 0], [3, 3], [1, 0]]))
    adv, _ = get_advantage("reinforce_pp_baseline")(batch, AdvantageConfig())
    torch.testing.assert_close(adv, (raw - 1 / 7) / math.sqrt(9 / 14 + 1e-8) * mask)


def test_remax():
    """gamma 1: returns-to-go [1, 1, 1] and [0.5, 0.5, 0]; minus greedy scores 0.5 and 1."""
    batch = AdvantageInputs(
        t([[0, 0, 1], [0, 0.5, 0]]), t([[1, 1, 1], [1, 1, 0]]), extras={"greedy_scores": t([0.5, 1.0])}
    )
    adv, ret = get_advantage("remax")(batch, AdvantageConfig())
    torch.testing.assert_close(adv, t([[0.5, 0.5, 0.5], [-0.5, -0.5, 0]]))
    torch.testing.assert_close(ret, t([[1, 1, 1], [0.5, 0.5, 0]]))


def test_missing_inputs_and_bad_config_name_the_field():
    batch = AdvantageInputs(t([[1.0]]), t([[1.0]]))
    for name, field in [("gae", "values"), ("grpo", "group_ids"), ("remax", "greedy_scores")]:
        with pytest.raises(ValueError, match=field):
            get_advantage(name)(batch, AdvantageConfig())
    with pytest.raises(ValueError, match="advantage.gamma"):
        AdvantageConfig(gamma=1.5).validate()


def test_discounted_returns_gamma_one_is_reverse_cumsum():
    """gamma 1 over a full mask: G_t = sum_{k >= t} r_k, so [1, 2, 3] -> [6, 5, 3]."""
    torch.testing.assert_close(discounted_returns(t([[1, 2, 3]]), t([[1, 1, 1]]), 1.0), t([[6, 5, 3]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mode", ["std", "mean", "rloo"])
def test_group_identical_scores_give_exactly_zero(mode, dtype):
    """Groups of 16 copies of 0.7, 0.1, 1/3, -2.3 (interleaved): their plain mean
    is 1 ulp off, which (s - mean) / (std + eps) blew up to ~0.1; deviations from
    a group member (the minimum) are exactly 0. A masked NaN token reward does
    not reach the score (sequence_scores selects, not multiplies)."""
    s = torch.tensor([0.7, 0.1, 1 / 3, -2.3], dtype=dtype).repeat(16)
    ids = torch.arange(4).repeat(16)
    assert (group_normalized_scores(s, ids, mode) == 0).all()
    rewards = torch.stack([torch.zeros_like(s), s, torch.full_like(s, math.nan)], -1)  # (64, 3)
    mask = torch.tensor([1.0, 1.0, 0.0]).expand(64, 3)
    batch = AdvantageInputs(rewards, mask, group_ids=ids)
    name = {"std": "grpo", "mean": "grpo", "rloo": "rloo"}[mode]
    adv, _ = get_advantage(name)(batch, AdvantageConfig(norm_by_std=mode != "mean"))
    assert (adv == 0).all()
