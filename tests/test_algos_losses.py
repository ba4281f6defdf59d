"""Policy/value/entropy losses and loss aggregation against hand-computed values."""
import math

import pytest
import torch

from megarl.algos.aggregation import Aggregation, agg_loss, count_tokens_and_seqs
from megarl.algos.losses import PolicyLossConfig, entropy_loss, get_policy_loss, value_loss

D = torch.float64


def t(x, **kw):
    return torch.tensor(x, dtype=D, **kw)


# Tokens: (A, r) = (1, 1.5), (1, 0.5), (-1, 0.5), (-1, 1.5); clip range [0.8, 1.3].
ADV = t([[1, 1, -1, -1]])
RATIO = [1.5, 0.5, 0.5, 1.5]


def _ppo(cfg):
    logp = t([[math.log(r) for r in RATIO]], requires_grad=True)
    loss, metrics = get_policy_loss("ppo")(logp, torch.zeros(1, 4, dtype=D), ADV, torch.ones(1, 4), cfg)
    loss.backward()
    return loss, metrics, logp.grad


def test_ppo_clip_asymmetric():
    """clip_low 0.2, clip_high 0.3. Per token max(-A r, -A clip(r, 0.8, 1.3)):
    t0: max(-1.5, -1.3) = -1.3 (clipped); t1: max(-0.5, -0.8) = -0.5;
    t2: max(0.5, 0.8) = 0.8 (clipped); t3: max(1.5, 1.3) = 1.5.
    token-mean: (-1.3 - 0.5 + 0.8 + 1.5) / 4 = 0.125; clip_frac 2/4.
    Gradient d(-A r)/dlogp = -A r at unclipped tokens, / 4: t1 -0.125, t3 0.375.
    approx_kl = mean of r - 1 - ln r: 2 * (0.5 - ln 1.5) + 2 * (-0.5 + ln 2), / 4."""
    loss, metrics, grad = _ppo(PolicyLossConfig(clip_low=0.2, clip_high=0.3))
    assert math.isclose(loss.item(), 0.125)
    assert math.isclose(_ppo(PolicyLossConfig(clip_low=0.2, clip_high=0.3, clip_c=0))[0].item(), 0.125)
    torch.testing.assert_close(grad, t([[0, -0.125, 0, 0.375]]))
    assert metrics["clip_frac"].item() == 0.5 and metrics["dual_clip_frac"].item() == 0.0
    kl = (2 * (0.5 - math.log(1.5)) + 2 * (-0.5 + math.log(2))) / 4
    assert math.isclose(metrics["approx_kl"].item(), kl, rel_tol=1e-12)


def test_ppo_dual_clip():
    """clip_c 1.4 bounds A < 0 losses by 1.4 * -A = 1.4: t3's 1.5 becomes 1.4 (and
    its gradient 0); t2's 0.8 stays. Loss (-1.3 - 0.5 + 0.8 + 1.4) / 4 = 0.1."""
    loss, metrics, grad = _ppo(PolicyLossConfig(clip_low=0.2, clip_high=0.3, clip_c=1.4))
    assert math.isclose(loss.item(), 0.1)
    torch.testing.assert_close(grad, t([[0, -0.125, 0, 0]]))
    assert metrics["dual_clip_frac"].item() == 0.25
    with pytest.raises(ValueError, match="clip_c"):
        PolicyLossConfig(clip_c=0.9).validate()


def test_gspo_sequence_ratio_and_gradient():
    """Clip range 0.1 each side; seq-mean-token-mean.
    Row 0: log-ratios [0.1, 0.3] -> s = e^0.2 = 1.2214 > 1.1, A = 1: both tokens
      clipped, loss -1.1 each, no gradient.
    Row 1: log-ratios [-0.05, 5 (masked)] -> s = e^-0.05 = 0.95123, A = -1:
      unclipped, loss s; d/dlogp_0 = s (token form: sg[s] * p/sg[p]) times the
      aggregation weight 1/2 (2 sequences, 1 token).
    Loss (-1.1 + e^-0.05) / 2; clip_frac 2/3."""
    cfg = PolicyLossConfig(gspo_clip_low=0.1, gspo_clip_high=0.1)
    logp = t([[0.1, 0.3], [-0.05, 5.0]], requires_grad=True)
    mask = t([[1, 1], [1, 0]])
    loss, metrics = get_policy_loss("gspo")(
        logp, torch.zeros(2, 2, dtype=D), t([[1, 1], [-1, -1]]), mask, cfg, Aggregation("seq-mean-token-mean")
    )
    loss.backward()
    s1 = math.exp(-0.05)
    assert math.isclose(loss.item(), (-1.1 + s1) / 2, rel_tol=1e-12)
    torch.testing.assert_close(logp.grad, t([[0, 0], [s1 / 2, 0]]))
    assert math.isclose(metrics["clip_frac"].item(), 2 / 3, rel_tol=1e-6)  # fractions are float32


LOSS = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [9.0, 9.0, 9.0]]
MASK = [[1, 1, 0], [1, 0, 0], [0, 0, 0]]  # row 2 is padding


@pytest.mark.parametrize(
    "mode, kw, expected",
    [
        ("token-mean", {}, 7 / 3),  # (1 + 2 + 4) / 3 tokens
        ("seq-mean-token-sum", {}, 3.5),  # (3 + 4) / 2 sequences; padding row not counted
        ("seq-mean-token-mean", {}, 2.75),  # (1.5 + 4) / 2
        ("seq-mean-token-sum-norm", {"norm_len": 4}, 0.875),  # (3/4 + 4/4) / 2
        ("seq-mean-token-sum-norm", {}, 7 / 6),  # norm_len defaults to T = 3: (1 + 4/3) / 2
        ("token-mean", {"global_tokens": 14}, 0.5),  # 7 / 14
        ("seq-mean-token-sum", {"global_seqs": 7}, 1.0),  # 7 / 7
    ],
)
def test_agg_modes(mode, kw, expected):
    assert math.isclose(agg_loss(t(LOSS), t(MASK), mode, **kw).item(), expected)


def test_agg_unknown_mode():
    with pytest.raises(ValueError, match="available: token-mean"):
        agg_loss(t(LOSS), t(MASK), "mean")
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        Aggregation("sum")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batch_split_invariance(mode):
    """Every mode is sum(per-sequence terms) / N, so with N of the whole batch
    given to each micro-batch, summing micro-batch losses gives the whole-batch
    loss and gradient. Splits [0:2], [2:3], [3:7] stand for micro-batches and DP
    ranks alike; rows have 1..5 real tokens, one row none. Not covered: the real
    all-reduce of the counts and DDP's averaging (see aggregation's docstring)."""
    g = torch.Generator().manual_seed(0)
    loss_mat = torch.randn(7, 5, generator=g, dtype=D)
    lengths = torch.tensor([5, 1, 3, 0, 2, 4, 5])
    mask = (torch.arange(5)[None, :] < lengths[:, None]).to(D)  # (7, 5)

    def run(slices, **norm):
        x = loss_mat.clone().requires_grad_(True)
        total = sum(Aggregation(mode, norm_len=5, **norm)(x[s], mask[s]) for s in slices)
        total.backward()
        return total, x.grad

    whole, whole_grad = run([slice(0, 7)])
    tokens, seqs = count_tokens_and_seqs(mask)
    assert (tokens.item(), seqs.item()) == (20.0, 6.0)
    parts = [slice(0, 2), slice(2, 3), slice(3, 7)]
    split, split_grad = run(parts, global_tokens=tokens, global_seqs=seqs)
    torch.testing.assert_close(split, whole)
    torch.testing.assert_close(split_grad, whole_grad)
    local, _ = run(parts)  # local normalizers: a different loss, so the test can fail
    assert not torch.allclose(local, whole)


def test_value_loss_clipped():
    """clip_eps 0.2, 0.5 * token-mean of max((v - R)^2, (clip(v, old +- 0.2) - R)^2):
    t0 v 1.0, old 0.5, R 1.0: max(0, (0.7 - 1)^2) = 0.09 (clipped);
    t1 v 2.0, old 2.1, R 1.0: v within range, 1;
    t2 v 0.0, old 1.0, R 0.5: max(0.25, (0.8 - 0.5)^2 = 0.09) = 0.25.
    0.5 * (0.09 + 1 + 0.25) / 3; clip_frac 1/3. Unclipped: 0.5 * (0 + 1 + 0.25) / 3."""
    v, old, ret, mask = t([[1.0, 2.0, 0.0]]), t([[0.5, 2.1, 1.0]]), t([[1.0, 1.0, 0.5]]), t([[1, 1, 1]])
    loss, metrics = value_loss(v, old, ret, mask, clip_eps=0.2)
    assert math.isclose(loss.item(), 0.5 * 1.34 / 3)
    assert math.isclose(metrics["vf_clip_frac"].item(), 1 / 3, rel_tol=1e-6)
    loss, metrics = value_loss(v, old, ret, mask, clip_eps=None)
    assert math.isclose(loss.item(), 0.5 * 1.25 / 3) and metrics["vf_clip_frac"].item() == 0.0
    assert math.isclose(value_loss(v, old, ret, mask, clip_eps=0.0)[0].item(), 0.5 * 1.25 / 3)  # 0 disables


def test_entropy_bonus():
    """Real entropies 1, 2, 3: token mean 2, loss -0.01 * 2."""
    loss, metrics = entropy_loss(t([[1, 2], [3, 4]]), t([[1, 1], [1, 0]]), coef=0.01)
    assert math.isclose(loss.item(), -0.02) and metrics["entropy"].item() == 2.0


def _in_range_but_shifted(n=8, eps=0.5):
    """fp32 (v, old, R), n tokens each, with |v - old| < eps (checked in fp64 with a
    margin) where the old form old + clamp(v - old, -eps, eps) is 1 ulp off v and
    moves it away from R, so comparing squares flagged the token as clipped. v and
    old of different magnitudes make v - old inexact; found by search, fixed seed."""
    g = torch.Generator().manual_seed(0)
    v, old = (torch.rand(4096, generator=g) * 0.8 - 0.4 for _ in range(2))
    ret = torch.randn(4096, generator=g)
    shifted = old + (v - old).clamp(-eps, eps)
    bad = (shifted != v) & ((shifted - ret) ** 2 > (v - ret) ** 2)
    bad &= (v.double() - old.double()).abs() < eps - 1e-3
    idx = bad.nonzero().flatten()[:n]
    assert len(idx) == n, "search found too few tokens; widen it"
    return v[idx][None], old[idx][None], ret[idx][None]  # (1, n) each


def test_value_loss_in_range_is_never_clipped():
    """Tokens with |v - old| < eps, where the old v_clip was 1 ulp off v (see the
    helper): vf_clip_frac is 0, the loss equals 0.5 * mean (v - R)^2 exactly and
    so does its gradient. The old form flagged every one of them (checked)."""
    v, old, ret = _in_range_but_shifted()
    mask = torch.ones_like(v)
    shifted = old + (v - old).clamp(-0.5, 0.5)
    assert ((shifted - ret) ** 2 > (v - ret) ** 2).all()  # the old metric: all clipped
    vc = v.clone().requires_grad_(True)
    loss, metrics = value_loss(vc, old, ret, mask, clip_eps=0.5)
    loss.backward()
    vu = v.clone().requires_grad_(True)
    plain, _ = value_loss(vu, old, ret, mask, clip_eps=None)
    plain.backward()
    assert metrics["vf_clip_frac"].item() == 0.0
    assert torch.equal(loss, plain)
    torch.testing.assert_close(vc.grad, vu.grad, rtol=0, atol=0)


AGG_ALL = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
POISON = [math.nan, math.inf, -math.inf]


def _poisoned(x: torch.Tensor, mask: torch.Tensor, value: float) -> torch.Tensor:
    return torch.where(mask.bool(), x, value)


@pytest.mark.parametrize("poison", POISON)
@pytest.mark.parametrize("mode", AGG_ALL)
def test_agg_ignores_masked_nan_and_inf(mode, poison):
    """A NaN or +-inf at a masked position gives the loss and gradient of a 0
    there (x * 0 would make both NaN); the gradient is finite, 0 off the mask."""
    g = torch.Generator().manual_seed(1)
    loss_mat = torch.randn(3, 5, generator=g, dtype=D)
    mask = t([[1, 1, 0, 1, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]])

    def run(x):
        x = x.clone().requires_grad_(True)
        out = agg_loss(x, mask, mode, norm_len=5 if mode.endswith("norm") else None)
        out.backward()
        return out, x.grad

    want, want_grad = run(_poisoned(loss_mat, mask, 0.0))
    got, got_grad = run(_poisoned(loss_mat, mask, poison))
    assert torch.isfinite(got) and torch.equal(got, want)
    assert torch.isfinite(got_grad).all() and torch.equal(got_grad, want_grad)
    assert (got_grad[mask == 0] == 0).all()


@pytest.mark.parametrize("poison", POISON)
@pytest.mark.parametrize("name", ["ppo", "gspo", "value", "entropy", "kl"])
def test_losses_ignore_masked_nan_and_inf(name, poison):
    """Every input of a loss poisoned at masked positions (log-probs, advantages,
    values, returns, entropies): loss, metrics and the gradient of the trained
    input equal those with 0 there, and stay finite. Without the selection a NaN
    reached the gradient through products like -A * r even with agg fixed."""
    from megarl.algos.kl import kl_loss

    g = torch.Generator().manual_seed(2)
    a, b, c = (torch.randn(3, 5, generator=g, dtype=D) * 0.1 for _ in range(3))
    mask = t([[1, 1, 0, 1, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
    agg = Aggregation("seq-mean-token-mean")
    fns = {
        "ppo": lambda x, y, z: get_policy_loss("ppo")(x, y, z, mask, PolicyLossConfig(clip_c=3.0), agg),
        "gspo": lambda x, y, z: get_policy_loss("gspo")(x, y, z, mask, PolicyLossConfig(), agg),
        "value": lambda x, y, z: value_loss(x, y, z, mask, clip_eps=0.05, agg=agg),
        "entropy": lambda x, y, z: entropy_loss(x, mask, 0.01, agg),
        "kl": lambda x, y, z: kl_loss(x, y, mask, "low_var_kl", agg),
    }

    def run(fill):
        x = _poisoned(a, mask, fill).requires_grad_(True)
        loss, metrics = fns[name](x, _poisoned(b, mask, fill), _poisoned(c, mask, fill))
        loss.backward()
        return loss, metrics, x.grad

    want, want_m, want_grad = run(0.0)
    got, got_m, got_grad = run(poison)
    assert torch.isfinite(got) and torch.equal(got, want)
    assert all(torch.equal(got_m[k], want_m[k]) for k in want_m), (got_m, want_m)
    assert torch.isfinite(got_grad).all() and torch.equal(got_grad, want_grad)


def test_gspo_clip_range_comes_from_actor_config():
    """actor.gspo_clip_low/high=0.1 on the command line reach the loss through the
    trainer's policy_loss_config: the same loss as test_gspo_sequence_ratio_and_gradient
    (row 0's s = e^0.2 clipped at 1.1). The defaults are the paper's 3e-4 / 4e-4."""
    from megarl.cli import load_config
    from megarl.config import ActorConfig, Config
    from megarl.roles.policy import policy_loss_config

    cfg = load_config(["actor.gspo_clip_low=0.1", "actor.gspo_clip_high=1e-1", "actor.clip_high=0.28"], Config)
    loss_cfg = policy_loss_config(cfg.actor)
    assert (loss_cfg.gspo_clip_low, loss_cfg.gspo_clip_high, loss_cfg.clip_high) == (0.1, 0.1, 0.28)
    default = policy_loss_config(ActorConfig())
    assert (default.gspo_clip_low, default.gspo_clip_high) == (3e-4, 4e-4)
    logp = t([[0.1, 0.3], [-0.05, 5.0]])
    args = (logp, torch.zeros(2, 2, dtype=D), t([[1, 1], [-1, -1]]), t([[1, 1], [1, 0]]))
    loss, _ = get_policy_loss("gspo")(*args, loss_cfg, Aggregation("seq-mean-token-mean"))
    assert math.isclose(loss.item(), (-1.1 + math.exp(-0.05)) / 2, rel_tol=1e-12)
    assert not math.isclose(get_policy_loss("gspo")(*args, default, Aggregation("seq-mean-token-mean"))[0].item(),
                            loss.item())
