"""Advantage estimators: a registry of `fn(batch, cfg) -> (advantages, returns)`.

Register with `@register_advantage("name")`; select with `get_advantage(name)`
where name is a registered name or a dotted path 'pkg.module:function' to a
user function of the same signature:

    fn(batch: AdvantageInputs, cfg: AdvantageConfig) -> (advantages (B, T), returns (B, T))

Both outputs are 0 at positions where `batch.response_mask` is 0.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from megarl.algos.masked import masked_sum, masked_whiten
from megarl.algos.registry import Registry
from megarl.errors import ExtensionError
from megarl.algos.returns import discounted_returns, gae_advantages, group_advantages, group_normalized_scores


@dataclass
class AdvantageConfig:
    """Settings shared by the estimators; each reads only the fields it needs."""

    gamma: float = 1.0
    """Discount per response token (gae, reinforce_pp*, remax)."""
    lam: float = 1.0
    """GAE lambda (gae)."""
    whiten: bool = True
    """Masked whitening of the advantages over the batch (gae, reinforce_pp*)."""
    norm_by_std: bool = True
    """grpo: divide by the group std; False gives Dr.GRPO (mean-centred only)."""
    eps: float = 1e-6
    """Added to the group std before dividing (grpo)."""

    def validate(self) -> None:
        for key in ("gamma", "lam"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ValueError(f"advantage.{key}={getattr(self, key)} must be in [0, 1]")
        if self.eps <= 0:
            raise ValueError(f"advantage.eps={self.eps} must be > 0")


@dataclass
class AdvantageInputs:
    """One batch of rollouts as the estimators see it."""

    token_rewards: Tensor
    """(B, T) per-token rewards over the response (score on the last token, KL-in-reward if used)."""
    response_mask: Tensor
    """(B, T) 1 for real response tokens."""
    values: Tensor | None = None
    """(B, T) critic values (gae only)."""
    scores: Tensor | None = None
    """(B,) sequence scores; when None, the masked sum of token_rewards."""
    group_ids: Tensor | None = None
    """(B,) ints; samples of one prompt share an id (group estimators)."""
    extras: dict[str, Tensor] = field(default_factory=dict)
    """Estimator-specific inputs, e.g. "greedy_scores" (B,) for remax."""

    def sequence_scores(self) -> Tensor:
        if self.scores is not None:
            return self.scores.to(self.token_rewards.dtype)
        return masked_sum(self.token_rewards, self.response_mask, dim=-1)

    def require(self, name: str, estimator: str) -> Tensor:
        """Field `name`, else extras[name]; a ValueError naming both when absent."""
        value = getattr(self, name, None)
        if value is None:
            value = self.extras.get(name)
        if value is None:
            raise ValueError(f"advantage estimator {estimator!r} needs batch.{name} or batch.extras[{name!r}]")
        return value


AdvantageFn = Callable[[AdvantageInputs, AdvantageConfig], "tuple[Tensor, Tensor]"]
ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")
register_advantage = ADVANTAGES.register


def get_advantage(name_or_path: str) -> AdvantageFn:
    """A registered estimator name, or a dotted path 'pkg.module:function' to
    `fn(batch: AdvantageInputs, cfg: AdvantageConfig) -> (advantages (B, T), returns (B, T))`."""
    return ADVANTAGES.get(name_or_path)


def compute_advantages(name_or_path: str, batch: AdvantageInputs, cfg: AdvantageConfig) -> tuple[Tensor, Tensor]:
    """(advantages, returns), each (B, T) and finite on response tokens, or an ExtensionError."""
    out = get_advantage(name_or_path)(batch, cfg)
    check_advantage_output(name_or_path, out, batch)
    return out


def check_advantage_output(name: str, out, batch: AdvantageInputs) -> None:
    """An estimator's result must be two (B, T) tensors, finite where the mask is set: a
    wrong shape would be broadcast silently and a NaN would reach the optimizer."""
    key = f"algorithm.advantage={name!r}"
    want = tuple(batch.token_rewards.shape)
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(t, Tensor) for t in out)):
        raise ExtensionError(f"{key} returned {type(out).__name__}; return (advantages, returns), two {want} tensors")
    for label, t in zip(("advantages", "returns"), out):
        if tuple(t.shape) != want:
            raise ExtensionError(f"{key} returned {label} of shape {tuple(t.shape)}; want {want} (B, T) like "
                                 "batch.token_rewards")
        bad = int((~torch.isfinite(t) & (batch.response_mask != 0)).sum())
        if bad:
            raise ExtensionError(f"{key} returned NaN/inf {label} at {bad} response tokens; the run stops before "
                                 "this update (fix the estimator, e.g. guard its divisions)")


@register_advantage("gae")
def gae(batch: AdvantageInputs, cfg: AdvantageConfig) -> tuple[Tensor, Tensor]:
    """PPO's GAE(gamma, lam); returns = A + V; A whitened when cfg.whiten."""
    values = batch.require("values", "gae")
    return gae_advantages(batch.token_rewards, values, batch.response_mask, cfg.gamma, cfg.lam, cfg.whiten)


def _group(batch: AdvantageInputs, mode: str, eps: float, estimator: str) -> tuple[Tensor, Tensor]:
    ids = batch.require("group_ids", estimator)
    adv = group_advantages(batch.sequence_scores(), ids, batch.response_mask, mode, eps)
    return adv, adv


@register_advantage("grpo")
def grpo(batch: AdvantageInputs, cfg: AdvantageConfig) -> tuple[Tensor, Tensor]:
    """(score - group mean) / (group std + eps); Dr.GRPO when not cfg.norm_by_std."""
    return _group(batch, "std" if cfg.norm_by_std else "mean", cfg.eps, "grpo")


@register_advantage("rloo")
def rloo(batch: AdvantageInputs, cfg: AdvantageConfig) -> tuple[Tensor, Tensor]:
    """Score minus the mean score of the other samples of its group."""
    return _group(batch, "rloo", cfg.eps, "rloo")


@register_advantage("reinforce_pp")
def reinforce_pp(batch: AdvantageInputs, cfg: AdvantageConfig) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted return-to-go of token rewards, whitened over the batch."""
    mask = batch.response_mask
    returns = discounted_returns(batch.token_rewards, mask, cfg.gamma)
    adv = masked_whiten(returns, mask) if cfg.whiten else returns
    return adv, returns


@register_advantage("reinforce_pp_baseline")
def reinforce_pp_baseline(batch: AdvantageInputs, cfg: AdvantageConfig) -> tuple[Tensor, Tensor]:
    """REINFORCE++ with baseline: return-to-go minus the group mean score, then whitened.

    The baseline is the mean of `sequence_scores()` over the sample's group
    (subtracted at every real token); with gamma=1 and only a final-token score
    this is (score - group mean) broadcast over the response.
    """
    ids = batch.require("group_ids", "reinforce_pp_baseline")
    mask = batch.response_mask
    scores = batch.sequence_scores()
    baseline = scores - group_normalized_scores(scores, ids, "mean")  # (B,) group means
    returns = discounted_returns(batch.token_rewards, mask, cfg.gamma)
    adv = torch.where(mask != 0, returns - baseline[:, None], 0.0)
    if cfg.whiten:
        adv = masked_whiten(adv, mask)
    return adv, returns


@register_advantage("remax")
def remax(batch: AdvantageInputs, cfg: AdvantageConfig) -> tuple[Tensor, Tensor]:
    """ReMax: return-to-go minus the greedy response's score, extras["greedy_scores"] (B,)."""
    greedy = batch.require("greedy_scores", "remax").to(batch.token_rewards.dtype)
    mask = batch.response_mask.to(batch.token_rewards.dtype)
    returns = discounted_returns(batch.token_rewards, mask, cfg.gamma)
    return torch.where(mask != 0, returns - greedy[:, None], 0.0), returns
