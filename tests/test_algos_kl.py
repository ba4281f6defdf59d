"""KL estimators, KL in the reward, KL loss and the beta controllers."""
import math

import pytest
import torch

from megarl.algos.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_to_rewards,
    kl_loss,
    kl_penalty,
)

D = torch.float64
L2 = math.log(2)
# Token 0: p = 0.5, ref = 0.25 (logp - ref = ln 2); token 1: p = 0.25, ref = 0.5 (-ln 2).
LOGP = torch.tensor([[math.log(0.5), math.log(0.25)]], dtype=D)
REF = torch.tensor([[math.log(0.25), math.log(0.5)]], dtype=D)


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("k1", [L2, -L2]),
        ("abs", [L2, L2]),
        ("k2", [0.5 * L2**2, 0.5 * L2**2]),
        ("mse", [0.5 * L2**2, 0.5 * L2**2]),
        # exp(ref - logp) - (ref - logp) - 1: exp(-ln 2) + ln 2 - 1 = 0.5 + ln 2 - 1; 2 - ln 2 - 1
        ("k3", [L2 - 0.5, 1 - L2]),
        ("low_var_kl", [L2 - 0.5, 1 - L2]),
    ],
)
def test_estimators(kind, expected):
    torch.testing.assert_close(kl_penalty(LOGP, REF, kind), torch.tensor([expected], dtype=D))


def test_k3_clamped_and_unknown():
    """ref - logp = 5: e^5 - 5 - 1 = 142.4 is clamped to 10."""
    assert kl_penalty(torch.zeros(1, 1), torch.full((1, 1), 5.0), "k3").item() == 10.0
    with pytest.raises(ValueError, match="available: k1, abs"):
        kl_penalty(LOGP, REF, "k4")


def test_apply_kl_to_rewards():
    """beta 0.5: -0.5 * kl at real tokens, plus the score at the last real token.
    Row 0: [-0.05, -0.1, -0.15 + 1]; row 1 (last real token 1): [-0.2, -0.25 + 2, 0];
    row 2, mask with a gap [1, 0, 1]: [-0.35, 0, -0.45 + 3]; row 3 empty: zeros."""
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9], [1.0, 1.0, 1.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 1], [0, 0, 0]])
    out = apply_kl_to_rewards(torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=D), kl, mask, beta=0.5)
    expected = [[-0.05, -0.1, 0.85], [-0.2, 1.75, 0], [-0.35, 0, 2.55], [0, 0, 0]]
    torch.testing.assert_close(out, torch.tensor(expected, dtype=D))


def test_kl_loss_token_mean():
    """k1 over tokens [ln 2, -ln 2, masked]: token mean 0."""
    logp = torch.cat([LOGP, torch.zeros(1, 1, dtype=D)], 1)
    ref = torch.cat([REF, torch.ones(1, 1, dtype=D)], 1)
    loss, metrics = kl_loss(logp, ref, torch.tensor([[1, 1, 0]]), kind="k1")
    assert abs(loss.item()) < 1e-15 and abs(metrics["kl"].item()) < 1e-15


def test_adaptive_controller():
    """init 0.1, target 6, horizon 10000.
    kl 9: err = 9/6 - 1 = 0.5, clipped to 0.2; beta = 0.1 * (1 + 0.2 * 256 / 10000) = 0.100512.
    kl 5.4: err = -0.1; beta *= 1 - 0.1 * 1000 / 10000 = 0.99 -> 0.09950688."""
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(9.0, n_steps=256)
    assert math.isclose(ctl.beta, 0.100512)
    ctl.update(5.4, n_steps=1000)
    assert math.isclose(ctl.beta, 0.09950688)
    restored = AdaptiveKLController(1.0, target=1.0, horizon=1.0)
    restored.load_state_dict(ctl.state_dict())
    assert (restored.beta, restored.target, restored.horizon) == (ctl.beta, 6.0, 10000.0)


def test_fixed_controller():
    ctl = FixedKLController(0.05)
    ctl.update(100.0, n_steps=64)
    assert ctl.beta == 0.05
    other = FixedKLController(0.0)
    other.load_state_dict(ctl.state_dict())
    assert other.beta == 0.05
