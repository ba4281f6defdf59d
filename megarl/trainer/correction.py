"""The step's rollout-correction metrics over the whole batch (every DP rank), logged every step.

Ratio rho_t = pi_old / pi_roll of each response token (old: the training forward
with the weights that sampled; roll: the engine's log-prob), whatever the mode:
its mean, max and min; the fractions of tokens whose weight the mode truncated
or that it dropped (0 with mode none); and the k3 estimate of
KL(pi_roll || pi_old), mean over tokens of rho - 1 - log rho (unbiased and
non-negative under the rollout's own samples). Formulas:
:mod:`megarl.algos.rollout_correction`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.algos.rollout_correction import RolloutCorrection, correct, correction_sums
from megarl.roles.batch import SampleBatch

PREFIX = "rollout_correction/"
_SUMMED = ("tokens", "ratio_sum", "truncated", "masked", "kl_k3")


def rollout_correction_metrics(batch: SampleBatch, rc: RolloutCorrection, dp_group) -> dict[str, float]:
    """Identical on every rank (sums and extrema reduced over ``dp_group``); {} without both log-probs."""
    if batch.old_logprobs is None or batch.rollout_logprobs is None:
        return {}
    mask = batch.response_mask
    s = correction_sums(correct(batch.old_logprobs, batch.rollout_logprobs, mask, rc), mask)
    summed = torch.stack([s[k].double() for k in _SUMMED])  # (5,)
    extrema = torch.stack([s["ratio_max"].double(), -s["ratio_min"].double()])  # (2,) both for a MAX
    if dp_group is not None:
        dist.all_reduce(summed, group=dp_group)
        dist.all_reduce(extrema, op=dist.ReduceOp.MAX, group=dp_group)
    n, ratio_sum, truncated, masked, kl = summed.tolist()  # n: response tokens of the whole batch
    if n == 0:
        return {}
    return {f"{PREFIX}ratio_mean": ratio_sum / n, f"{PREFIX}ratio_max": float(extrema[0]),
            f"{PREFIX}ratio_min": -float(extrema[1]), f"{PREFIX}truncated_frac": truncated / n,
            f"{PREFIX}masked_frac": masked / n, f"{PREFIX}kl_k3": kl / n}
