"""Rewards for a rollout: rule/user terms plus an optional reward model, from the config."""
from __future__ import annotations

import torch

from megarl.config import RewardConfig
from megarl.rewards import CompositeReward, RewardCache, RewardModelTerm, RewardSample, RewardTerm
from megarl.trainer.rollout import Rollout


def build_reward(cfg: RewardConfig, rm_scorer=None) -> CompositeReward:
    """``rm_scorer(rollout_batch) -> (B,)`` is the reward-model role, when configured."""
    terms = [
        RewardTerm(name=t.name, weight=t.weight, kwargs=dict(t.kwargs), fallback=cfg.fallback)
        for t in cfg.terms
    ]
    rm = None
    if cfg.model.path:
        rm = RewardModelTerm(
            weight=cfg.model.weight, scale=cfg.model.scale, fallback=cfg.fallback,
            clip=tuple(cfg.model.clip) if cfg.model.clip else None, scorer=rm_scorer,
        )
    cache = RewardCache(cfg.cache_size) if cfg.cache_size > 0 else None
    return CompositeReward(terms, rm=rm, cache=cache)


def score_rollout(reward: CompositeReward, rollout: Rollout) -> dict[str, float]:
    """Fills ``rollout.scores`` (B,); returns per-term sums for DP reduction."""
    samples = [
        RewardSample(prompt=p, response=r, ground_truth=a, extra=e)
        for p, r, a, e in zip(rollout.prompts, rollout.responses, rollout.answers, rollout.extras)
    ]
    out = reward(samples, rm_batch=rollout.batch)
    device = rollout.batch.input_ids.device
    rollout.scores = out.total.float().to(device)
    metrics = {f"reward/{k}_sum": float(v.sum()) for k, v in out.terms.items()}
    metrics.update({f"reward/{k}": v for k, v in out.metrics.items() if k.endswith("failures")})
    metrics.update(score_metrics(rollout.scores))
    return metrics


def score_metrics(scores: torch.Tensor) -> dict[str, float]:
    """Local sums for the score mean and std."""
    return {"score/sum": float(scores.sum()), "score/sq_sum": float((scores.double() ** 2).sum()),
            "score/count": float(len(scores))}


def finish_score_metrics(m: dict[str, float]) -> dict[str, float]:
    """DP-summed sums -> means and std."""
    n = max(m.pop("score/count", 1.0), 1.0)
    mean = m.pop("score/sum") / n
    var = max(m.pop("score/sq_sum") / n - mean * mean, 0.0)
    out = {"score/mean": mean, "score/std": var ** 0.5}
    for k in [k for k in m if k.startswith("reward/") and k.endswith("_sum")]:
        out[k[: -len("_sum")] + "/mean"] = m.pop(k) / n
    out.update({k: v for k, v in m.items() if k.startswith("reward/")})
    return out
