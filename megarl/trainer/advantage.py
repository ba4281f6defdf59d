"""Token rewards (score + KL penalty) and advantages over the whole global batch.

Whitening and group statistics must not depend on how the batch is split over
data-parallel ranks, so the per-token inputs are gathered over DP, every rank
computes the same advantages for the global batch, and keeps its own rows.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.algos import (
    AdvantageConfig,
    AdvantageInputs,
    apply_kl_to_rewards,
    compute_advantages,
    kl_penalty,
    masked_sum,
)
from megarl.config import AlgorithmConfig
from megarl.roles.batch import pad_to
from megarl.trainer.rollout import Rollout


def gather_rows(t: torch.Tensor, group) -> tuple[torch.Tensor, int]:
    """All-gathers (b, ...) over ``group`` (equal b, dim 1 padded to the max); returns
    the (world * b, ...) tensor and this rank's first row."""
    world = dist.get_world_size(group) if group is not None else 1
    if world == 1:
        return t, 0
    if t.dim() == 2:
        width = torch.tensor([t.size(1)], device=t.device)
        dist.all_reduce(width, op=dist.ReduceOp.MAX, group=group)
        t = pad_to(t, int(width))
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts), dist.get_rank(group) * t.size(0)


def token_kl(rollout: Rollout, estimator: str) -> torch.Tensor:
    """(B, L) KL(policy || ref) per response token from the stored log-probs."""
    b = rollout.batch
    if b.ref_logprobs is None:
        return torch.zeros_like(b.response_mask)
    return kl_penalty(b.old_logprobs, b.ref_logprobs, estimator) * b.response_mask


def kl_sum(rollout: Rollout, estimator: str) -> float:
    """Local sum over response tokens of KL(policy || ref) under the old log-probs."""
    return float(masked_sum(token_kl(rollout, estimator), rollout.batch.response_mask))


def compute_rollout_advantages(rollout: Rollout, cfg: AlgorithmConfig, beta: float, dp_group) -> dict:
    """Fills batch.advantages and batch.returns (B, L); returns local sums (advantages, tokens).

    The KL penalty (``cfg.kl_in_reward``) needs the old log-probs; without it they
    may come after this (from an on-policy update's own forward).
    """
    b = rollout.batch
    mask = b.response_mask
    if b.old_logprobs is not None:
        kl = token_kl(rollout, cfg.kl_estimator)
    elif cfg.kl_in_reward:
        raise ValueError("algorithm.kl_in_reward=true needs old_logprobs before the advantages")
    else:
        kl = torch.zeros_like(mask)
    rewards = apply_kl_to_rewards(rollout.scores, kl, mask, beta if cfg.kl_in_reward else 0.0)
    local = {"rewards": rewards, "mask": mask, "scores": rollout.scores, "groups": rollout.group_ids}
    if b.values is not None:
        local["values"] = b.values
    if b.greedy_scores is not None:
        local["greedy"] = b.greedy_scores
    full, start = {}, 0
    for key, value in local.items():
        full[key], start = gather_rows(value, dp_group)
    inputs = AdvantageInputs(
        token_rewards=full["rewards"], response_mask=full["mask"], values=full.get("values"),
        scores=full["scores"], group_ids=full["groups"],
        extras={"greedy_scores": full["greedy"]} if "greedy" in full else {},
    )
    adv_cfg = AdvantageConfig(gamma=cfg.gamma, lam=cfg.lam, whiten=cfg.whiten, norm_by_std=cfg.norm_by_std)
    adv, ret = compute_advantages(cfg.advantage, inputs, adv_cfg)  # (B_global, L')
    rows = slice(start, start + len(b))
    b.advantages = pad_to(adv[rows], b.width)
    b.returns = pad_to(ret[rows], b.width)
    tokens = float(mask.sum())
    return {"kl/tokens": tokens, "advantage/sum": float(masked_sum(b.advantages, mask))}


def logprob_mismatch(rollout: Rollout) -> dict[str, float]:
    """Rollout-engine vs training log-probs (old_logprobs: the weights that generated) of the
    same tokens (local sums and max)."""
    b, mask = rollout.batch, rollout.batch.response_mask
    diff = torch.where(mask != 0, (b.rollout_logprobs - b.old_logprobs).abs(), 0.0)
    return {"mismatch/abs_sum": float(diff.sum()), "mismatch/abs_max": float(diff.max()),
            "mismatch/tokens": float(mask.sum())}

