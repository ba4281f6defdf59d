"""Rollout routing replay (``actor.router_replay=r3``) in a PPO step: its checks and its metrics.

With r3 the actor's old-log-prob forward (or, when that is skipped, the on-policy update's forward)
routes to the recorded experts, so ``mismatch/abs_mean`` and ``mismatch/abs_max`` measure the
rollout-vs-training log-prob gap *with* replay, and ``r3/agreement`` (per layer and mean) is the
fraction of recorded (token, k) choices the training router's own top-k holds in that forward.
Every ``actor.router_replay_probe_every`` steps one more forward-only pass of the same batch routes
by the router's own choice: ``mismatch/no_replay/abs_mean``, ``mismatch/no_replay/abs_max`` and
``r3/no_replay/agreement`` are what the run would see without replay (there a layer's agreement
also carries the differences routed in the layers before it). All of these are over recorded
tokens (every prompt and response token but a sequence's last) with the weights that generated, the same on every rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.errors import DataError


def require_expert_ids(batch) -> None:
    """r3 needs the rollout's expert ids in the batch."""
    if batch.expert_ids is None:
        raise DataError("actor.router_replay=r3: the rollout batch holds no recorded expert ids (dumps written "
                        "without r3 or rollout.record_experts, or an SGLang that returned none?); dump them again "
                        "with actor.router_replay=r3, or set actor.router_replay=none")


def probe_without_replay(batch, actor, step: int, every: int, forward) -> dict[str, float]:
    """Clears the actor's agreement counts; on probe steps (``every`` > 0, ``step % every == 0``) runs
    ``forward()`` (the old-log-prob forward, {"logprobs": (B, L)}) with the routers choosing and returns
    its ``mismatch/no_replay/*`` and ``r3/no_replay/*`` metrics. Collective over the world."""
    replay = actor.replay
    replay.reset()
    if every <= 0 or step % every:
        return {}
    with replay.observing():
        plain = forward()["logprobs"]
    metrics = replay.read("r3/no_replay")
    metrics.update(mismatch_over_dp(batch, plain, actor.groups, "mismatch/no_replay"))
    return metrics


def mismatch_over_dp(batch, logprobs: torch.Tensor, groups, prefix: str) -> dict[str, float]:
    """|rollout - training| log-prob over response tokens of the whole DP group: mean and max."""
    mask = batch.response_mask != 0
    diff = torch.where(mask, (batch.rollout_logprobs - logprobs).abs(), 0.0)
    dev = diff.device
    sums = torch.tensor([float(diff.sum()), float(mask.sum())], dtype=torch.float64, device=dev)
    top = torch.tensor([float(diff.max()) if diff.numel() else 0.0], dtype=torch.float64, device=dev)
    if groups.dp_size > 1:
        dist.all_reduce(sums, group=groups.dp)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=groups.dp)
    total, tokens = sums.tolist()
    return {f"{prefix}/abs_mean": total / tokens if tokens > 0 else 0.0, f"{prefix}/abs_max": float(top[0])}
