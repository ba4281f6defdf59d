"""Numerical cores of the advantage estimators, in plain PyTorch.

These are the functions the fused kernels in `megarl_kernels` (gae,
group_advantage) replace; keep their signatures in step with those.

Masking convention (all functions): positions with mask 0 are skipped. They
get 0 in every output, and the recursions carry their state across them, so
the next *real* token is what a real token bootstraps from (multi-turn
observation tokens inside a response are skipped, and values/rewards in the
padding after the end never leak into the response).
"""
from __future__ import annotations

import torch
from torch import Tensor

from megarl_kernels import gae as fused_gae
from megarl_kernels import group_advantage as fused_group_advantage

GROUP_MODES = ("std", "mean", "rloo")


def gae_advantages(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float, whiten: bool = False
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation over response tokens.

    rewards, values, mask: (B, T). For real tokens, walking t backwards with
    (v', A') the value and advantage of the next real token (0 after the last):
        delta_t = r_t + gamma * v' - v_t
        A_t     = delta_t + gamma * lam * A'
    returns = A + values (before whitening). whiten: masked whitening of A.
    Returns (advantages (B, T), returns (B, T)), 0 at masked positions.
    Runs the fused scan of ``megarl_kernels.gae`` (Triton on CUDA, a vectorized
    scan on CPU); ``megarl_kernels.gae_ref`` is the per-timestep loop it replaces.
    """
    adv, ret = fused_gae(rewards, values, mask, gamma, lam, whiten=whiten)  # fp32
    return adv.to(values.dtype), ret.to(values.dtype)


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Return-to-go G_t = r_t + gamma * G' over real tokens (G' of the next real one).

    rewards, mask: (B, T) -> (B, T), 0 at masked positions.
    """
    real = mask.bool()
    out = torch.zeros_like(rewards)
    running = rewards.new_zeros(rewards.shape[0])  # (B,)
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(real[:, t], rewards[:, t] + gamma * running, running)
        out[:, t] = torch.where(real[:, t], running, 0.0)
    return out


def _group_stats(scores: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample (score - group mean, unbiased group var, group size), each (B,).

    Deviations are taken from a pivot, the group minimum (d = s - min, then
    d - mean(d)): a group of identical scores gets exactly 0, which the fp32
    mean of e.g. 0.7 repeated does not give.
    """
    _, inv = torch.unique(group_ids, return_inverse=True)  # inv: (B,) in [0, G)
    G = int(inv.max()) + 1 if inv.numel() else 0
    count = torch.zeros(G, dtype=scores.dtype, device=scores.device).index_add_(0, inv, torch.ones_like(scores))
    pivot = torch.full_like(count, float("inf")).scatter_reduce_(0, inv, scores, "amin")  # (G,)
    d = scores - pivot[inv]  # (B,)
    dev = d - (torch.zeros_like(count).index_add_(0, inv, d) / count)[inv]  # (B,)
    sq = torch.zeros_like(count).index_add_(0, inv, dev ** 2)
    var = (sq / (count - 1).clamp_min(1))[inv]  # size-1 groups: 0
    return dev, var, count[inv]


def group_normalized_scores(scores: Tensor, group_ids: Tensor, mode: str = "std", eps: float = 1e-6) -> Tensor:
    """Sequence advantages from scores relative to their group (same prompt).

    scores: (B,), group_ids: (B,) ints, groups need not be contiguous.
    mode "std":  (s - mean) / (std + eps), unbiased std (GRPO)
    mode "mean": s - mean (Dr.GRPO)
    mode "rloo": s - mean of the other samples = n / (n - 1) * (s - mean)
    A group of one sample, or of identical scores, gets exactly 0 in every mode. Returns (B,).
    """
    if mode not in GROUP_MODES:
        raise ValueError(f"unknown group mode {mode!r}; available: {', '.join(GROUP_MODES)}")
    s = scores if scores.is_floating_point() else scores.float()
    centered, var, n = _group_stats(s, group_ids)
    if mode == "std":
        return centered / (var.sqrt() + eps)
    if mode == "rloo":
        return centered * n / (n - 1).clamp_min(1)
    return centered


def group_advantages(
    scores: Tensor, group_ids: Tensor, mask: Tensor, mode: str = "std", eps: float = 1e-6
) -> Tensor:
    """group_normalized_scores broadcast over the response: (B,) -> (B, T) * mask.

    Runs ``megarl_kernels.group_advantage`` (two Triton launches on CUDA).
    """
    if mode not in GROUP_MODES:
        raise ValueError(f"unknown group mode {mode!r}; available: {', '.join(GROUP_MODES)}")
    s = scores if scores.is_floating_point() else scores.float()
    return fused_group_advantage(s, group_ids, mask, mode=mode, eps=eps).to(s.dtype)  # fp32 inside
