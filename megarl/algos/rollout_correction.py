"""Rollout correction: importance weights and masks for tokens sampled by another policy.

The rollout engine samples token y_t with its own log-prob (``rollout_logprobs``,
pi_roll); the training forward with the same weights gives ``old_logprobs``
(pi_old). They differ by kernel rounding (another engine, bf16), by staleness
(asynchronous or partial rollouts) or both. PPO's ratio pi_new / pi_old assumes
y ~ pi_old; these terms fix the expectation back. All tensors (B, T) over
response tokens with ``mask`` (B, T); i indexes sequences, t tokens.

    log rho_t = clamp(old_t - roll_t, -20, 20)            (one function: log_ratio)
    rho_t     = exp(log rho_t)                            token ratio pi_old / pi_roll
    rho_i     = exp(sum_t log rho_t)                      sequence ratio, seq_ratio=product
              = exp(mean_t log rho_t)                     seq_ratio=geo_mean (length-free)

Modes (weight w, keep k; the loss of token t becomes w_t * loss_t over kept tokens):

    none     w = 1, k = 1
    tis      token truncated IS:   w_t = min(rho_t, C)                  k = 1
    seq_is   sequence IS:          w_it = min(rho_i, C)                 k = 1
    mis      masked (rejection):   w = 1, k_t = [low <= rho_t <= high]  (level=token)
                                   w = 1, k_it = [low <= rho_i <= high] (level=sequence)
    icepop   band mask and IS:     w_t = rho_t, k_t = [low <= rho_t <= high]

mis only drops: what is kept keeps weight 1 (the ratio picks the samples, it
does not re-weight them); icepop keeps rho_t on the tokens inside the band and
drops the rest. With rho = 1 everywhere (identical log-probs) every mode gives
w = 1 and k = 1 exactly (C >= 1 and low < 1 < high are checked by the config),
so the loss is the uncorrected one bit for bit.

Metrics (local sums, reduced by the caller): the token ratio rho_t's sum, max,
min; tokens truncated (w < rho, tis / seq_is) and masked (k = 0); and the k3
estimate of KL(pi_roll || pi_old) = E_roll[log pi_roll - log pi_old]:
rho - 1 - log rho per token, unbiased and non-negative under y ~ pi_roll (the
samples' own policy) since E_roll[rho] = 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megarl.algos.masked import masked_mean

LOG_RATIO_CLAMP = 20.0  # keeps exp() finite; far outside any cap or band
MODES = ("none", "tis", "seq_is", "mis", "icepop")
LEVELS = ("token", "sequence")
SEQ_RATIOS = ("product", "geo_mean")


@dataclass(frozen=True)
class RolloutCorrection:
    """One mode and its thresholds (see the module docstring)."""

    mode: str = "none"
    """none | tis | seq_is | mis | icepop."""
    cap: float = 2.0
    """C of tis and seq_is: weights are min(ratio, C); >= 1."""
    level: str = "token"
    """mis: drop tokens (token) or whole sequences (sequence)."""
    seq_ratio: str = "geo_mean"
    """seq_is and mis at sequence level: product or geo_mean of the token ratios."""
    low: float = 0.5
    """mis / icepop: band's lower end, in (0, 1)."""
    high: float = 2.0
    """mis / icepop: band's upper end, > 1."""

    @property
    def enabled(self) -> bool:
        return self.mode != "none"


PRESETS = {  # algorithm.rollout_correction.preset -> the setting it stands for
    "none": RolloutCorrection(),
    # another engine's kernels: ratios near 1, a bias but no heavy tail -> truncated token IS
    "sglang": RolloutCorrection(mode="tis", cap=2.0),
    # stale tokens: wider, heavy-tailed ratios -> drop outside [0.5, 2], re-weight inside
    "async": RolloutCorrection(mode="icepop", low=0.5, high=2.0),
}


@dataclass
class Correction:
    """What the loss applies: weights (B, T) and the kept tokens (B, T), both 0 off the mask."""

    weights: Tensor  # (B, T) detached, 0 at masked-out or dropped tokens
    keep: Tensor  # (B, T) bool: mask and not dropped
    truncated: Tensor  # (B, T) bool: the weight was capped below the ratio
    log_ratio: Tensor  # (B, T) log rho_t, 0 off the mask


def log_ratio(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> Tensor:
    """(B, T) log rho_t = clamp(old - roll, +-20) on the mask, 0 elsewhere (selected, so a
    NaN or inf off the mask stays out)."""
    real = mask != 0
    diff = torch.where(real, old_logprobs.detach(), 0.0) - torch.where(real, rollout_logprobs.detach(), 0.0)
    return diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def sequence_log_ratio(log_rho: Tensor, mask: Tensor, how: str) -> Tensor:
    """(B,) log rho_i: sum_t (product) or mean_t (geo_mean) of log rho_t over the mask."""
    if how == "product":
        return torch.where(mask != 0, log_rho, 0.0).sum(-1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if how == "geo_mean":
        return masked_mean(log_rho, mask, dim=-1)
    raise ValueError(f"unknown seq_ratio {how!r}; available: {', '.join(SEQ_RATIOS)}")


def correct(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, rc: RolloutCorrection) -> Correction:
    """The weights and kept tokens of ``rc.mode`` (formulas in the module docstring)."""
    real = mask != 0
    lr = log_ratio(old_logprobs, rollout_logprobs, mask)  # (B, T)
    rho = torch.exp(lr)
    ones = torch.ones_like(rho)
    truncated = torch.zeros_like(real)
    keep = real
    if rc.mode == "none":
        weights = ones
    elif rc.mode == "tis":
        weights, truncated = rho.clamp(max=rc.cap), rho > rc.cap
    elif rc.mode == "seq_is":
        rho_seq = torch.exp(sequence_log_ratio(lr, mask, rc.seq_ratio))[:, None].expand_as(rho)  # (B, T)
        weights, truncated = rho_seq.clamp(max=rc.cap), rho_seq > rc.cap
    elif rc.mode == "mis":
        ratio = rho if rc.level == "token" else torch.exp(sequence_log_ratio(lr, mask, rc.seq_ratio))[:, None]
        weights, keep = ones, real & (ratio >= rc.low) & (ratio <= rc.high)
    elif rc.mode == "icepop":
        weights, keep = rho, real & (rho >= rc.low) & (rho <= rc.high)
    else:
        raise ValueError(f"unknown rollout correction mode {rc.mode!r}; available: {', '.join(MODES)}")
    return Correction(weights=torch.where(keep, weights, 0.0), keep=keep, truncated=truncated & keep,
                      log_ratio=lr)


def correction_sums(c: Correction, mask: Tensor) -> dict[str, Tensor]:
    """Local sums over the mask's tokens: tokens, ratio sum / max / min, truncated, masked, k3 KL.

    Max and min over an empty mask are -inf and inf (neutral for a MAX / MIN reduction)."""
    real = mask != 0
    rho = torch.exp(c.log_ratio)
    k3 = torch.expm1(c.log_ratio) - c.log_ratio  # rho - 1 - log rho
    inf = torch.tensor(float("inf"), dtype=rho.dtype, device=rho.device)
    return {
        "tokens": real.sum().to(rho.dtype),
        "ratio_sum": torch.where(real, rho, 0.0).sum(),
        "ratio_max": torch.where(real, rho, -inf).max() if rho.numel() else -inf,
        "ratio_min": torch.where(real, rho, inf).min() if rho.numel() else inf,
        "truncated": (c.truncated & real).sum().to(rho.dtype),
        "masked": (real & ~c.keep).sum().to(rho.dtype),
        "kl_k3": torch.where(real, k3, 0.0).sum(),
    }


def from_section(section) -> RolloutCorrection:
    """The setting of an ``algorithm.rollout_correction`` section: its preset's, or (preset none) its keys'."""
    if section.preset != "none":
        return PRESETS[section.preset]
    return RolloutCorrection(mode=section.mode, cap=section.cap, level=section.level, seq_ratio=section.seq_ratio,
                             low=section.low, high=section.high)


def keys_read(rc: RolloutCorrection) -> tuple[str, ...]:
    """The threshold keys ``rc.mode`` reads (the others are ignored by it)."""
    if rc.mode in ("tis", "seq_is"):
        return ("cap", "seq_ratio") if rc.mode == "seq_is" else ("cap",)
    if rc.mode == "mis":
        return ("level", "low", "high") + (("seq_ratio",) if rc.level == "sequence" else ())
    return ("low", "high") if rc.mode == "icepop" else ()
