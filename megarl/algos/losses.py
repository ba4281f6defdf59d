"""Actor and critic losses: policy losses (a registry), clipped value loss, entropy bonus.

Policy losses are registered names or dotted paths 'pkg.module:function' to a
function of this signature (all tensors (B, T) over response tokens):

    fn(logp, old_logp, advantages, mask, cfg: PolicyLossConfig, agg: Aggregation)
        -> (loss: scalar Tensor, metrics: dict[str, Tensor])

Inputs at masked-out positions are ignored, NaN and inf included: they are
replaced by 0 (selected, not multiplied) before any arithmetic, so they reach
neither the loss nor the gradient.

Metrics are detached scalars, token means over this batch's mask:
    clip_frac       tokens whose clipped term is the one used
    approx_kl       k3 estimate of KL(old || new): r - 1 - log r, r = exp(logp - old_logp);
                    non-negative and unbiased under samples of the old policy
    dual_clip_frac  tokens (A < 0) whose loss the dual clip bound replaced
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from megarl.algos.aggregation import Aggregation
from megarl.algos.masked import masked_mean, zero_masked
from megarl.algos.registry import Registry

Metrics = dict[str, Tensor]
LOG_RATIO_CLAMP = 20.0  # keeps exp() finite; far outside any clip range


@dataclass
class PolicyLossConfig:
    """Clip ranges of the policy losses."""

    clip_low: float = 0.2
    """ppo_clip: ratio lower bound is 1 - clip_low."""
    clip_high: float = 0.2
    """ppo_clip: ratio upper bound is 1 + clip_high (DAPO's clip-higher uses e.g. 0.28)."""
    clip_c: float | None = None
    """Dual clip (e.g. 3.0): for A < 0 the loss is at most clip_c * -A; None or 0 disables."""
    gspo_clip_low: float = 3e-4
    """gspo: sequence ratio lower bound 1 - gspo_clip_low (GSPO paper: 3e-4)."""
    gspo_clip_high: float = 4e-4
    """gspo: sequence ratio upper bound 1 + gspo_clip_high (GSPO paper: 4e-4)."""

    def validate(self) -> None:
        for key in ("clip_low", "clip_high", "gspo_clip_low", "gspo_clip_high"):
            if getattr(self, key) < 0:
                raise ValueError(f"policy_loss.{key}={getattr(self, key)} must be >= 0")
        if self.clip_c and self.clip_c <= 1.0:
            raise ValueError(f"policy_loss.clip_c={self.clip_c} must be > 1 (or None/0 to disable dual clip)")


PolicyLossFn = Callable[[Tensor, Tensor, Tensor, Tensor, PolicyLossConfig, Aggregation], "tuple[Tensor, Metrics]"]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")
register_policy_loss = POLICY_LOSSES.register


def get_policy_loss(name_or_path: str) -> PolicyLossFn:
    """A registered policy loss name, or a dotted path 'pkg.module:function' to
    `fn(logp, old_logp, advantages, mask, cfg: PolicyLossConfig, agg: Aggregation) -> (loss, metrics)`."""
    return POLICY_LOSSES.get(name_or_path)


def _k3(log_ratio: Tensor) -> Tensor:
    return torch.expm1(log_ratio) - log_ratio


def _clipped_surrogate(ratio: Tensor, adv: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    """(max(-A r, -A clip(r, 1-low, 1+high)), mask of where the clipped term won)."""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - low, 1.0 + high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


@register_policy_loss("ppo")
@register_policy_loss("ppo_clip")
def ppo_clip(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
    cfg: PolicyLossConfig, agg: Aggregation = Aggregation(),
) -> tuple[Tensor, Metrics]:
    """PPO clipped surrogate with asymmetric clip range and optional dual clip."""
    logp, old_logp, advantages = zero_masked(mask, logp, old_logp, advantages)
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T)
    loss, clipped = _clipped_surrogate(torch.exp(log_ratio), advantages, cfg.clip_low, cfg.clip_high)
    dual = torch.zeros_like(clipped)
    if cfg.clip_c:
        bound = -advantages * cfg.clip_c  # positive where A < 0
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
    metrics = {
        "clip_frac": masked_mean(clipped.float(), mask).detach(),
        "approx_kl": masked_mean(_k3(log_ratio), mask).detach(),
        "dual_clip_frac": masked_mean(dual.float(), mask).detach(),
    }
    return agg(loss, mask), metrics


@register_policy_loss("gspo")
def gspo(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
    cfg: PolicyLossConfig, agg: Aggregation = Aggregation(),
) -> tuple[Tensor, Metrics]:
    """GSPO with the token-level form of the sequence ratio (GSPO-token).

    s_i = exp(mean_t (logp - old_logp)) over sequence i's real tokens; token t
    uses s_it = sg[s_i] * p_t / sg[p_t], equal to s_i in value, with gradient
    s_i * grad logp_t. Clipped to [1 - gspo_clip_low, 1 + gspo_clip_high]. The
    paper averages tokens within a sequence, then sequences:
    Aggregation("seq-mean-token-mean").
    """
    logp, old_logp, advantages = zero_masked(mask, logp, old_logp, advantages)
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T)
    seq_log_ratio = masked_mean(log_ratio, mask, dim=-1)  # (B,)
    log_s = seq_log_ratio.detach()[:, None] + logp - logp.detach()  # (B, T), value = seq ratio
    ratio = torch.exp(log_s.clamp(max=LOG_RATIO_CLAMP))
    loss, clipped = _clipped_surrogate(ratio, advantages, cfg.gspo_clip_low, cfg.gspo_clip_high)
    metrics = {
        "clip_frac": masked_mean(clipped.float(), mask).detach(),
        "approx_kl": masked_mean(_k3(log_ratio), mask).detach(),
        "dual_clip_frac": torch.zeros((), dtype=loss.dtype),
    }
    return agg(loss, mask), metrics


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
    clip_eps: float | None = 0.2, agg: Aggregation = Aggregation(),
) -> tuple[Tensor, Metrics]:
    """PPO's clipped value loss: 0.5 * max((v - R)^2, (clip(v, v_old +- eps) - R)^2).

    All (B, T). clip_eps None or 0: plain 0.5 * (v - R)^2. Metric vf_clip_frac:
    tokens where the clipped term is larger. v is clamped to [v_old - eps,
    v_old + eps] directly, so inside the range v_clip is v itself and such a
    token is never counted as clipped (v_old + clamp(v - v_old) can be 1 ulp
    off v) and its loss is exactly the unclipped one.
    """
    values, old_values, returns = zero_masked(mask, values, old_values, returns)
    unclipped = (values - returns) ** 2
    if not clip_eps:
        loss, clipped = unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        v_clip = values.clamp(old_values - clip_eps, old_values + clip_eps)
        clipped_sq = (v_clip - returns) ** 2
        loss, clipped = torch.maximum(unclipped, clipped_sq), clipped_sq > unclipped
    metrics = {"vf_clip_frac": masked_mean(clipped.float(), mask).detach()}
    return 0.5 * agg(loss, mask), metrics


def entropy_loss(
    entropy: Tensor, mask: Tensor, coef: float, agg: Aggregation = Aggregation()
) -> tuple[Tensor, Metrics]:
    """Entropy bonus as a loss: -coef * agg(entropy (B, T)); metric: token-mean entropy."""
    (entropy,) = zero_masked(mask, entropy)
    return -coef * agg(entropy, mask), {"entropy": masked_mean(entropy, mask).detach()}
