"""Rewards for a rollout: rule/user terms plus an optional reward model, from the config."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megarl.config import RewardConfig
from megarl.rewards import CompositeReward, RewardCache, RewardModelTerm, RewardSample, RewardTerm
from megarl.rewards.cache import open_reward_cache
from megarl.trainer.rollout import Rollout


def build_reward(cfg: RewardConfig, rm_scorer=None, run_dir: str = ".") -> CompositeReward:
    """``rm_scorer(rollout_batch) -> (B,)`` is the reward-model role, when configured."""
    terms = [
        RewardTerm(name=t.name, weight=t.weight, kwargs=dict(t.kwargs), fallback=cfg.fallback, cache=t.cache)
        for t in cfg.terms
    ]
    rm = None
    if cfg.model.path:
        rm = RewardModelTerm(
            weight=cfg.model.weight, scale=cfg.model.scale, fallback=cfg.fallback,
            clip=tuple(cfg.model.clip) if cfg.model.clip else None, scorer=rm_scorer,
        )
    return CompositeReward(terms, rm=rm, cache=build_cache(cfg, run_dir))


def build_cache(cfg: RewardConfig, run_dir: str) -> RewardCache | None:
    """The configured reward cache, or None (``cache_size=0``).

    Every rank looks up its own samples (scoring needs no collective); the ranks of
    one TP x PP replica score the same samples, so they ask for the same keys and
    write the same values.
    """
    if cfg.cache_size <= 0:
        return None
    path = cfg.cache_path or os.path.join(run_dir, "reward_cache.sqlite")
    cache = open_reward_cache(cfg.cache, cfg.cache_size, path, cfg.redis_url)
    if not dist.is_initialized() or dist.get_rank() == 0:
        where = {"memory": f"{cfg.cache_size} entries per process", "sqlite": path,
                 "redis": f"{cfg.redis_url}, written through to {path}"}[cfg.cache]
        print(f"reward cache: {cfg.cache} ({where})", flush=True)
    return cache


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
    metrics.update({f"reward/{k}": v for k, v in out.metrics.items() if k.startswith("cache/")})
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
    if "reward/cache/hits" in out:  # this step's hit rate over the DP ranks
        lookups = out["reward/cache/hits"] + out["reward/cache/misses"]
        out["reward/cache/hit_rate"] = out["reward/cache/hits"] / lookups if lookups else 0.0
    return out
