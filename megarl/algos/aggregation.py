"""Reducing a (B, T) per-token loss to a scalar: `agg_loss`.

Modes
    token-mean               sum(loss * mask) / N_tokens
    seq-mean-token-sum       sum_i (sum_t loss_it) / N_seqs
    seq-mean-token-mean      sum_i (mean_t loss_it) / N_seqs
    seq-mean-token-sum-norm  sum_i (sum_t loss_it / norm_len) / N_seqs   (Dr.GRPO)

N_seqs counts sequences with at least one real token (padding rows are
ignored); norm_len is a constant (the configured max response length; it
defaults to T, which is only constant if every micro-batch is padded alike).
Masked-out positions are selected away, not multiplied by 0, so a NaN or inf
there changes neither the loss nor its gradient.

Splitting a batch into whole sequences (micro-batches, data-parallel ranks)
    Every mode is a sum of per-sequence terms over one normalizer. Pass the
    normalizer of the *whole* batch -- `global_tokens` (token-mean) or
    `global_seqs` (seq-mean-*) -- to each micro-batch's call and *sum* the
    micro-batch losses (accumulate gradients without dividing by their
    number): the gradient equals that of the whole batch. Get the counts with
    `count_tokens_and_seqs(mask)` per micro-batch, summed over micro-batches
    and all-reduced (SUM) over the DP axis. DDP *averages* gradients over the
    DP axis, so multiply each loss by the DP size to keep the global sum.

Weights and dropped tokens (rollout correction)
    `weights` (B, T) multiply the per-token loss before the reduction. When
    tokens were dropped from `mask`, `count_mask` (the mask before dropping)
    gives the normalizers: N_tokens, N_seqs and a sequence's own token count in
    seq-mean-token-mean. A dropped token is then a token of weight 0, and what
    is kept is not scaled up; with all weights 1 and nothing dropped the loss
    is bit for bit the plain one.

`Aggregation` bundles a mode with its normalizers; the losses take one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def count_tokens_and_seqs(mask: Tensor) -> tuple[Tensor, Tensor]:
    """(number of real tokens, number of sequences with a real token) of mask (B, T)."""
    m = mask.float()
    return m.sum(), (m.sum(-1) > 0).float().sum()


def _normalizer(local: Tensor, global_value: float | Tensor | None) -> Tensor | float:
    return local.clamp_min(1.0) if global_value is None else global_value


def agg_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str = "token-mean",
    *,
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    norm_len: float | None = None,
    weights: Tensor | None = None,
    count_mask: Tensor | None = None,
) -> Tensor:
    """Scalar loss from loss_mat (B, T) over mask (B, T); see the module docstring.

    global_tokens / global_seqs: normalizers of the whole batch (None: this
    batch's own counts); each mode reads the one it needs.
    norm_len: seq-mean-token-sum-norm's constant divisor (None: T).
    weights: (B, T) per-token factors (None: 1); count_mask: (B, T) the mask the
    normalizers count (None: mask).
    """
    m = (mask if count_mask is None else count_mask).to(loss_mat.dtype)
    tokens, seqs = count_tokens_and_seqs(m)
    per_token = torch.where(mask != 0, loss_mat, 0.0)  # (B, T); NaN * 0 would be NaN
    if weights is not None:
        per_token = per_token * torch.where(mask != 0, weights, 0.0)
    if mode == "token-mean":
        return per_token.sum() / _normalizer(tokens, global_tokens)
    if mode == "seq-mean-token-sum":
        per_seq = per_token.sum(-1)  # (B,)
    elif mode == "seq-mean-token-mean":
        per_seq = per_token.sum(-1) / m.sum(-1).clamp_min(1.0)
    elif mode == "seq-mean-token-sum-norm":
        per_seq = per_token.sum(-1) / (norm_len if norm_len is not None else loss_mat.shape[-1])
    else:
        raise ValueError(f"unknown loss aggregation {mode!r}; available: {', '.join(AGG_MODES)}")
    return per_seq.sum() / _normalizer(seqs, global_seqs)


@dataclass(frozen=True)
class Aggregation:
    """How a loss reduces: agg_loss's mode and normalizers, as one argument."""

    mode: str = "token-mean"
    """One of AGG_MODES."""
    global_tokens: float | Tensor | None = None
    """Real tokens in the whole batch (token-mean); None: the local count."""
    global_seqs: float | Tensor | None = None
    """Sequences in the whole batch (seq-mean-*); None: the local count."""
    norm_len: float | None = None
    """seq-mean-token-sum-norm's divisor, the max response length; None: T."""
    weights: Tensor | None = None
    """(B, T) factors of the per-token loss (rollout correction); None: 1."""
    count_mask: Tensor | None = None
    """(B, T) mask the normalizers count, when tokens were dropped from the loss mask; None: that mask."""

    def __post_init__(self) -> None:
        if self.mode not in AGG_MODES:
            raise ValueError(f"unknown loss aggregation {self.mode!r}; available: {', '.join(AGG_MODES)}")

    def __call__(self, loss_mat: Tensor, mask: Tensor) -> Tensor:
        return agg_loss(
            loss_mat, mask, self.mode,
            global_tokens=self.global_tokens, global_seqs=self.global_seqs, norm_len=self.norm_len,
            weights=self.weights, count_mask=self.count_mask,
        )
