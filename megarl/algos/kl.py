"""KL between the policy and the reference: per-token estimators, KL in the
reward or in the loss, and the beta controllers (fixed, adaptive)."""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from megarl.algos.aggregation import Aggregation
from megarl.algos.masked import masked_mean, zero_masked

K3_CLAMP = 10.0  # bound on the k3 estimate; common practice, guards exp() blow-ups
LOG_RATIO_CLAMP = 20.0


def _k1(logp: Tensor, ref: Tensor) -> Tensor:
    return logp - ref


def _abs(logp: Tensor, ref: Tensor) -> Tensor:
    return (logp - ref).abs()


def _k2(logp: Tensor, ref: Tensor) -> Tensor:
    return 0.5 * (logp - ref) ** 2


def _k3(logp: Tensor, ref: Tensor) -> Tensor:
    d = (ref - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(d) - d - 1.0).clamp(-K3_CLAMP, K3_CLAMP)


KL_ESTIMATORS = {"k1": _k1, "abs": _abs, "k2": _k2, "mse": _k2, "k3": _k3, "low_var_kl": _k3}


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str = "k1") -> Tensor:
    """Per-token estimate of KL(policy || ref) from samples of the policy.

    logp, ref_logp: (B, T) log-probs of the sampled tokens -> (B, T).
    k1 (logp - ref), abs |logp - ref|, k2 = mse 0.5 (logp - ref)^2,
    k3 = low_var_kl exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10].
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; available: {', '.join(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[kind](logp, ref_logp)


def last_token_index(mask: Tensor) -> Tensor:
    """(B,) index of the last real token of each row of mask (B, T); 0 for empty rows."""
    T = mask.shape[-1]
    positions = torch.arange(T, device=mask.device).expand_as(mask)  # (B, T)
    return torch.where(mask.bool(), positions, -1).max(-1).values.clamp_min(0)


def apply_kl_to_rewards(scores: Tensor, kl: Tensor, mask: Tensor, beta: float) -> Tensor:
    """Token rewards with KL in the reward: -beta * kl per real token, plus the
    sequence score on the last real token.

    scores: (B,), kl, mask: (B, T) -> (B, T); rows without a real token get 0.
    """
    m = mask.to(kl.dtype)
    rewards = torch.where(m != 0, -beta * kl, 0.0)  # (B, T); a masked NaN stays out
    has_token = m.sum(-1) > 0  # (B,)
    score = torch.where(has_token, scores.to(kl.dtype), 0.0)
    return rewards.scatter_add(1, last_token_index(mask)[:, None], score[:, None])


def kl_loss(
    logp: Tensor, ref_logp: Tensor, mask: Tensor, kind: str = "low_var_kl", agg: Aggregation = Aggregation()
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL as a loss term (the caller scales it by beta): agg(kl_penalty(...)).

    Metric kl: token mean of the per-token estimate over this batch. Masked-out
    log-probs are replaced by 0 first, so a NaN there reaches no gradient.
    """
    kl = kl_penalty(*zero_masked(mask, logp, ref_logp), kind)
    return agg(kl, mask), {"kl": masked_mean(kl, mask).detach()}


class FixedKLController:
    """A constant beta."""

    def __init__(self, beta: float):
        self.beta = float(beta)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No change."""

    def state_dict(self) -> dict[str, Any]:
        return {"beta": self.beta}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.beta = float(state["beta"])


class AdaptiveKLController:
    """Adaptive beta of Ziegler et al. 2019 ("Fine-Tuning LMs from Human Preferences").

    err = clip(current_kl / target - 1, -0.2, 0.2); beta *= 1 + err * n_steps / horizon.
    n_steps: samples (or steps) covered by current_kl, typically the batch size.
    """

    ERR_CLIP = 0.2

    def __init__(self, init_beta: float, target: float, horizon: float):
        if target <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, got {target}, {horizon}")
        self.beta = float(init_beta)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        err = min(max(float(current_kl) / self.target - 1.0, -self.ERR_CLIP), self.ERR_CLIP)
        self.beta *= 1.0 + err * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"beta": self.beta, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.beta = float(state["beta"])
        self.target = float(state.get("target", self.target))
        self.horizon = float(state.get("horizon", self.horizon))
