"""Re-dealing a batch's rows over the data-parallel axis by token count.

Every DP rank holds its own rows. :func:`deal_rows` all-gathers the rows of
every rank (global row order: rank 0's rows, then rank 1's, ...), assigns them
to ranks by LPT on sequence lengths (:func:`megarl.data.balance.balance_lpt`;
every rank computes the same assignment from the same gathered lengths) and
returns this rank's share; when LPT's largest load is not below the current
one the rows stay where they are. ``keep_counts`` keeps each rank's number of
rows (fixed-size micro-batches need it); otherwise any number of rows may move.
:meth:`Dealt.back` sends per-row results (log-probs, values) back to the rank
and row they came from.

Losses stay exact: every loss is a sum of per-sequence terms over a global
normalizer (summed counts, :mod:`megarl.roles.optim`), so which rank runs a
sequence changes only the order of fp32 additions.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.distributed as dist

from megarl.data.balance import balance_lpt, max_over_mean
from megarl.distributed import device
from megarl.roles.batch import PER_POSITION, PER_SEQUENCE, PER_TOKEN, SampleBatch

_ROW_FIELDS = ("input_ids", "response_mask", "lengths") + PER_TOKEN + PER_SEQUENCE + PER_POSITION


@dataclass
class Dealt:
    """This rank's rows after balancing, and the way back."""

    batch: SampleBatch  # this rank's rows, in increasing global row order
    assignment: list[list[int]]  # global row ids run by each rank
    counts: list[int]  # rows each rank held before
    width: int  # the original batch's width
    imbalance: float  # max over mean of the ranks' tokens, after
    imbalance_before: float
    group: Optional[dist.ProcessGroup] = None  # None: no row moved

    def back(self, rows: torch.Tensor) -> torch.Tensor:
        """(b_dealt, w) | (b_dealt,) per-row results -> (b_original, width) | (b_original,) in
        this rank's original row order."""
        if self.group is None:
            return _fit(rows, self.width)
        per_rank = _gather_padded(rows, [len(a) for a in self.assignment], self.group)
        total = sum(self.counts)
        out = per_rank[0].new_zeros((total,) + per_rank[0].shape[1:])  # (N, w_max) | (N,)
        for ids, part in zip(self.assignment, per_rank):
            out[torch.as_tensor(ids, dtype=torch.long, device=out.device)] = part
        me = dist.get_rank(self.group)
        start = sum(self.counts[:me])
        return _fit(out[start:start + self.counts[me]], self.width)


def deal_rows(batch: SampleBatch, dp_group: Optional[dist.ProcessGroup], dp_size: int,
              keep_counts: bool) -> Dealt:
    """Balanced rows of the whole DP group for this rank (the batch itself at dp = 1)."""
    if dp_size == 1:
        return Dealt(batch, [list(range(len(batch)))], [len(batch)], batch.width, 1.0, 1.0)
    sizes = _gather_ints([len(batch), batch.width], dp_group)  # (dp, 2)
    counts = [int(c) for c in sizes[:, 0]]
    lengths = torch.cat(_gather_padded(batch.lengths, counts, dp_group)).tolist()  # (N,) every rank's
    held = _contiguous(counts)
    before = max_over_mean(_loads(lengths, held))
    assignment = balance_lpt(lengths, dp_size, counts if keep_counts else None)
    no_gain = max(_loads(lengths, assignment)) >= max(_loads(lengths, held))  # LPT is a heuristic
    if no_gain or min(map(len, assignment)) == 0:  # (a rank left without rows would have nothing to run)
        return Dealt(batch, held, counts, batch.width, before, before)  # rows stay: nothing to send back
    width = int(sizes[:, 1].max())
    gathered = {f: torch.cat(_gather_padded(getattr(batch, f), counts, dp_group, width)) for f in _ROW_FIELDS
                if getattr(batch, f) is not None}
    whole = replace(batch, **gathered)
    me = dist.get_rank(dp_group)
    return Dealt(whole.select(assignment[me]), assignment, counts, batch.width,
                 max_over_mean(_loads(lengths, assignment)), before, dp_group)


def _gather_ints(values: list[int], group) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.long, device=device())
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t, group=group)
    return torch.stack(parts).cpu()


def _gather_padded(t: torch.Tensor, counts: list[int], group, width: Optional[int] = None) -> list[torch.Tensor]:
    """Each rank's (counts[r], w_r, ...) | (counts[r],) tensor, padded to a common shape (past each
    row's length the padding is never read: :meth:`SampleBatch.select` cuts rows to their lengths)."""
    if width is None and t.dim() >= 2:
        width = int(_gather_ints([t.size(1)], group).max())
    shape = (max(counts),) + ((width, *t.shape[2:]) if t.dim() >= 2 else ())
    padded = t.new_zeros(shape)
    padded[tuple(slice(0, n) for n in t.shape)] = t
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return [p[:n] for p, n in zip(parts, counts)]


def _fit(t: torch.Tensor, width: int) -> torch.Tensor:
    if t.dim() != 2 or t.size(1) == width:
        return t
    if t.size(1) > width:
        return t[:, :width]
    return torch.nn.functional.pad(t, (0, width - t.size(1)))


def _contiguous(counts: list[int]) -> list[list[int]]:
    starts = [sum(counts[:r]) for r in range(len(counts))]
    return [list(range(s, s + n)) for s, n in zip(starts, counts)]


def _loads(lengths: list[int], assignment: list[list[int]]) -> list[float]:
    return [float(sum(lengths[i] for i in ids)) for ids in assignment]
