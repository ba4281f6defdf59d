"""Rollout correction (megarl/algos/rollout_correction.py) against its formulas, written out here.

Inputs are random (B = 5, T = 7, fp64) with old and rollout log-probs a few tenths
apart, so every mode truncates or drops some tokens (asserted, so a test cannot
pass by touching nothing). Each mode's weight w and keep k are recomputed
element by element in plain Python from the docstring's formulas; the corrected
PPO loss must equal sum w k l / N over the *response* mask's normalizers (a
dropped token is a token of weight 0), with and without a mask holding a
padded row and ragged lengths. With identical log-probs every mode gives the
uncorrected loss and gradient bit for bit. Not covered: the distributed sums of
the step metrics (tests/test_dapo.py runs them over 2 ranks in the tiny run).
"""
import math
from types import SimpleNamespace

import pytest
import torch

from megarl.algos.aggregation import Aggregation
from megarl.algos.losses import PolicyLossConfig, get_policy_loss
from megarl.algos.rollout_correction import (
    MODES,
    PRESETS,
    RolloutCorrection,
    correct,
    correction_sums,
    from_section,
)
from megarl.config import RolloutCorrectionConfig
from megarl.roles.batch import SampleBatch
from megarl.roles.policy import Policy

D = torch.float64
B, T = 5, 7
SETTINGS = {
    "tis": RolloutCorrection(mode="tis", cap=1.2),
    "seq_is-product": RolloutCorrection(mode="seq_is", cap=1.5, seq_ratio="product"),
    "seq_is-geo": RolloutCorrection(mode="seq_is", cap=1.05, seq_ratio="geo_mean"),
    "mis-token": RolloutCorrection(mode="mis", low=0.8, high=1.25),
    "mis-sequence-geo": RolloutCorrection(mode="mis", level="sequence", low=0.9, high=1.1),
    "mis-sequence-product": RolloutCorrection(mode="mis", level="sequence", seq_ratio="product", low=0.8, high=1.25),
    "icepop": RolloutCorrection(mode="icepop", low=0.8, high=1.25),
}


def _inputs(masked: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=D) * 2  # log-probs in (-2, 0]
    roll = old + torch.randn(B, T, generator=g, dtype=D) * 0.3
    logp = old + torch.randn(B, T, generator=g, dtype=D) * 0.1
    adv = torch.randn(B, T, generator=g, dtype=D)
    if masked:
        lengths = torch.tensor([7, 3, 0, 5, 1])  # row 2 is padding
        mask = (torch.arange(T)[None] < lengths[:, None]).to(D)
        roll = torch.where(mask.bool(), roll, math.nan)  # off the mask: poison, never read
    else:
        mask = torch.ones(B, T, dtype=D)
    return logp, old, roll, adv, mask


def _expected_weights(rc: RolloutCorrection, old, roll, mask):
    """(w, k) lists of lists from the module docstring's formulas, token by token."""
    w = [[0.0] * T for _ in range(B)]
    k = [[False] * T for _ in range(B)]
    for i in range(B):
        toks = [t for t in range(T) if mask[i, t]]
        lr = {t: float(old[i, t] - roll[i, t]) for t in toks}
        s = sum(lr.values())
        seq = math.exp(s if rc.seq_ratio == "product" else (s / len(toks) if toks else 0.0))
        for t in toks:
            rho = math.exp(lr[t])
            if rc.mode == "tis":
                w[i][t], k[i][t] = min(rho, rc.cap), True
            elif rc.mode == "seq_is":
                w[i][t], k[i][t] = min(seq, rc.cap), True
            elif rc.mode == "mis":
                r = rho if rc.level == "token" else seq
                w[i][t], k[i][t] = 1.0, rc.low <= r <= rc.high
            elif rc.mode == "icepop":
                w[i][t], k[i][t] = rho, rc.low <= rho <= rc.high
    return w, k


def _ppo_token_loss(logp, old, adv, i, t, cfg=PolicyLossConfig()):
    r = math.exp(float(logp[i, t] - old[i, t]))
    a = float(adv[i, t])
    return max(-a * r, -a * min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high))


def _corrected_loss(rc, logp, old, roll, adv, mask, mode):
    """The policy loss through Policy._corrected, as the update's head runs it."""
    policy = SimpleNamespace(correction=rc)
    mb = SampleBatch(torch.zeros(B, T, dtype=torch.long), mask, mask.sum(-1).long(), rollout_logprobs=roll)
    pg_mask, agg = Policy._corrected(policy, mb, old, Aggregation(mode))
    return get_policy_loss("ppo")(logp, old, adv, pg_mask, PolicyLossConfig(), agg)[0]


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_each_mode_equals_its_formula(name, masked):
    """w and k match the formulas; token-mean loss = sum_it w k l / N_tokens of the response
    mask; seq-mean-token-mean = sum_i (sum_t w k l / n_i) / N_seqs with n_i the row's
    response tokens. Some token is truncated or dropped and some is not (the test can fail)."""
    rc = SETTINGS[name]
    logp, old, roll, adv, mask = _inputs(masked)
    c = correct(old, roll, mask, rc)
    w, k = _expected_weights(rc, old, roll, mask)
    torch.testing.assert_close(c.weights, torch.tensor(w, dtype=D) * torch.tensor(k, dtype=D), rtol=1e-12, atol=0)
    assert c.keep.tolist() == k
    touched = (c.truncated | (mask.bool() & ~c.keep)).sum().item()
    assert 0 < touched < mask.sum().item(), name
    rows = [[t for t in range(T) if mask[i, t]] for i in range(B)]
    terms = [[w[i][t] * k[i][t] * _ppo_token_loss(logp, old, adv, i, t) for t in rows[i]] for i in range(B)]
    token_mean = sum(map(sum, terms)) / mask.sum().item()
    seq_mean = sum(sum(x) / len(x) for x in terms if x) / sum(1 for x in terms if x)
    for mode, expected in (("token-mean", token_mean), ("seq-mean-token-mean", seq_mean)):
        got = _corrected_loss(rc, logp, old, roll, adv, mask, mode).item()
        assert math.isclose(got, expected, rel_tol=1e-12), (mode, got, expected)


@pytest.mark.parametrize("loss_name, agg_mode", [("ppo", "token-mean"), ("ppo", "seq-mean-token-sum-norm"),
                                                 ("gspo", "seq-mean-token-mean"), ("ppo", "seq-mean-token-sum")])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_identical_logprobs_give_the_uncorrected_loss_exactly(name, masked, loss_name, agg_mode):
    """rollout == old: log rho = 0, rho = exp(0) = 1, so w = min(1, C) = 1 (C >= 1), 1 lies
    in every band (low < 1 < high): loss, metrics and gradient equal the plain ones bitwise."""
    logp, old, _, adv, mask = _inputs(masked)
    policy = SimpleNamespace(correction=SETTINGS[name])
    roll = torch.where(mask.bool(), old, math.nan)
    mb = SampleBatch(torch.zeros(B, T, dtype=torch.long), mask, mask.sum(-1).long(), rollout_logprobs=roll)
    fn, cfg, agg = get_policy_loss(loss_name), PolicyLossConfig(), Aggregation(agg_mode, norm_len=T)

    def run(pg_mask, pg_agg):
        x = logp.clone().requires_grad_(True)
        loss, metrics = fn(x, old, adv, pg_mask, cfg, pg_agg)
        loss.backward()
        return loss, metrics, x.grad

    plain = run(mask, agg)
    corrected = run(*Policy._corrected(policy, mb, old, agg))
    assert torch.equal(plain[0], corrected[0]) and torch.equal(plain[2], corrected[2])
    assert all(torch.equal(plain[1][key], corrected[1][key]) for key in plain[1])


@pytest.mark.parametrize("masked", [False, True])
def test_metrics_equal_their_formulas(masked):
    """Over the response tokens: ratio sum / max / min of rho_t, tokens truncated (tis,
    rho > C) or dropped (icepop, rho outside the band), and the k3 estimate of
    KL(roll || old): sum rho - 1 - log rho."""
    _, old, roll, _, mask = _inputs(masked)
    real = mask.bool()
    rho = [math.exp(float(old[i, t] - roll[i, t])) for i in range(B) for t in range(T) if real[i, t]]
    tis = correction_sums(correct(old, roll, mask, RolloutCorrection(mode="tis", cap=1.2)), mask)
    assert tis["tokens"].item() == len(rho)
    assert math.isclose(tis["ratio_sum"].item(), sum(rho), rel_tol=1e-12)
    assert math.isclose(tis["ratio_max"].item(), max(rho), rel_tol=1e-12)
    assert math.isclose(tis["ratio_min"].item(), min(rho), rel_tol=1e-12)
    assert tis["truncated"].item() == sum(r > 1.2 for r in rho) > 0 and tis["masked"].item() == 0
    assert math.isclose(tis["kl_k3"].item(), sum(r - 1 - math.log(r) for r in rho), rel_tol=1e-10)
    ice = correction_sums(correct(old, roll, mask, SETTINGS["icepop"]), mask)
    assert ice["masked"].item() == sum(not 0.8 <= r <= 1.25 for r in rho) > 0 and ice["truncated"].item() == 0


def test_off_and_presets():
    """Mode none is weight 1 everywhere; the presets resolve to the settings the README names,
    and preset none reads the section's keys; every config mode is a module mode."""
    _, old, roll, _, mask = _inputs(True)
    c = correct(old, roll, mask, RolloutCorrection())
    assert torch.equal(c.weights, mask) and torch.equal(c.keep, mask.bool())
    assert from_section(RolloutCorrectionConfig(preset="sglang")) == RolloutCorrection(mode="tis", cap=2.0)
    assert from_section(RolloutCorrectionConfig(preset="async")) == RolloutCorrection(mode="icepop", low=0.5, high=2.0)
    assert from_section(RolloutCorrectionConfig(mode="mis", level="sequence", high=3.0)) == RolloutCorrection(
        mode="mis", level="sequence", high=3.0)
    assert not PRESETS["none"].enabled
    modes = RolloutCorrectionConfig.__dataclass_fields__["mode"].type
    assert all(m in modes for m in MODES)
