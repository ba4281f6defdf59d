"""DAPO's pieces that are pure functions of tensors: overlong reward shaping and informative groups.

Overlong shaping (DAPO, "soft overlong punishment"), with L_max the response
limit (``rollout.max_new_tokens``), L_cache the buffer before it and |y| a
response's length in tokens, added to the response's score times ``factor``:

    R(|y|) = 0                                 |y| <= L_max - L_cache
           = ((L_max - L_cache) - |y|) / L_cache   L_max - L_cache < |y| <= L_max
           = -1                                |y| > L_max

It is continuous: 0 at the buffer's start, -1 at L_max.

Dynamic sampling keeps the groups (the n responses of one prompt) whose scores
are not all equal: a group of equal scores has zero group-normalized advantage
everywhere, so it adds nothing to the policy gradient but takes a share of the
batch.
"""
from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(response_lengths: Tensor, max_len: int, buffer: int, factor: float = 1.0) -> Tensor:
    """(B,) factor * R(|y|) of the module docstring; buffer 0: zeros."""
    lengths = response_lengths.double()
    if buffer <= 0:
        return torch.zeros_like(lengths)
    start = max_len - buffer
    ramp = (start - lengths) / buffer  # (B,) <= 0 past the buffer's start
    penalty = torch.where(lengths <= start, torch.zeros_like(lengths), ramp)
    penalty = torch.where(lengths > max_len, -torch.ones_like(lengths), penalty)
    return factor * penalty


def group_rows(group_ids: Tensor) -> list[list[int]]:
    """Row indices of each group, groups in order of their first row."""
    rows: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids.tolist()):
        rows.setdefault(g, []).append(i)
    return list(rows.values())


def informative_groups(scores: Tensor, group_ids: Tensor) -> list[tuple[list[int], bool]]:
    """(rows, informative) per group, in order: informative when its scores are not all equal."""
    out = []
    for rows in group_rows(group_ids):
        s = scores[rows]
        out.append((rows, bool((s != s[0]).any())))
    return out
