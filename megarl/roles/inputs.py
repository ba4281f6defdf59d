"""What the model reads for one micro-batch: padded rows or one packed (THD) row.

Padded: ``input_ids`` (b, l) right-padded, causal attention; padding tokens
are computed and ignored. Packed: the b sequences concatenated into (1, T),
T = sum of lengths (plus a padding segment up to a multiple of the TP size
under sequence parallelism), with ``PackedSeqParams(qkv_format="thd")`` so
attention stays inside each sequence and RoPE restarts at every sequence.

Both carry ``targets``: the next token of the same sequence at every position
(0 after a sequence's last token). A head computes one number per position
from it (the log-prob of the target, a value) and :meth:`ModelInputs.to_rows`
brings that back to the (b, l) per-token layout of :class:`SampleBatch`:
entry t of row i is the number computed at position t - 1 of sequence i
(column 0 and padding = 0), so log-probs, values and the loss code are the
same for both layouts. ``padding`` marks the tokens of no sequence (right padding, the pad
segment, CP's per-sequence padding): an MoE model routes none of them (megarl/models/moe_padding.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams

from megarl.data.packing import pack_rows
from megarl.models.context_parallel import CPLayout, cp_pack, gather_order


@dataclass
class ModelInputs:
    """One micro-batch as the model sees it."""

    input_ids: torch.Tensor  # (b, l) padded | (1, T) packed, long
    position_ids: torch.Tensor  # same shape; restarts at 0 at each sequence
    targets: torch.Tensor  # same shape, long: next token of the same sequence, 0 after its last token
    lengths: torch.Tensor  # (b,) tokens per sequence
    width: int  # l: the per-token width of the micro-batch's rows
    starts: Optional[torch.Tensor] = None  # (b,) packed: offset of each sequence in the row; None: padded
    packed_seq_params: Optional[PackedSeqParams] = None  # packed: thd boundaries
    cp: Optional[CPLayout] = None  # context parallel: the row above is this rank's slice of the global one
    padding: Optional[torch.Tensor] = None  # same shape as input_ids, bool: True at tokens of no sequence

    def global_row(self, per_position: torch.Tensor) -> torch.Tensor:
        """(1, t) this CP rank's numbers -> (1, T) the whole row's (as is without CP)."""
        return per_position if self.cp is None else self.cp.gather(per_position)

    @property
    def packed(self) -> bool:
        return self.packed_seq_params is not None

    def to_rows(self, per_position: torch.Tensor) -> torch.Tensor:
        """(b, l) | (1, T) number at each position for its target -> (b, width), shifted one
        to the right (entry t: computed at t - 1), 0 at column 0 and past each length."""
        if not self.packed:  # columns past width - 1: padding to the sequence-parallel multiple
            return F.pad(per_position[:, :self.width - 1], (1, 0))
        per_position = self.global_row(per_position)
        lengths = self.lengths.to(per_position.device)
        cols = torch.arange(self.width - 1, device=per_position.device)  # (l-1,)
        index = self.starts.to(per_position.device)[:, None] + cols  # (b, l-1) position in the row
        flat = per_position[0]  # (T,)
        picked = flat[index.clamp(max=flat.numel() - 1)]  # (b, l-1)
        return F.pad(torch.where(cols < lengths[:, None] - 1, picked, 0.0), (1, 0))

    def at_last_token(self, per_position: torch.Tensor) -> torch.Tensor:
        """(b, l) | (1, T) -> (b,): the number at each sequence's last token."""
        last = (self.lengths - 1).to(per_position.device)
        if not self.packed:
            return per_position[torch.arange(len(last), device=last.device), last]
        return self.global_row(per_position)[0, self.starts.to(last.device) + last]


def padded_inputs(input_ids: torch.Tensor, lengths: torch.Tensor, pad_multiple: int = 1) -> ModelInputs:
    """Right-padded rows (b, l) as they are, more padding columns up to a multiple of ``pad_multiple``
    (sequence parallelism splits the columns over the TP ranks)."""
    b, width = input_ids.shape
    input_ids = F.pad(input_ids, (0, -width % pad_multiple))  # (b, l') l' = l rounded up
    positions = torch.arange(input_ids.size(1), device=input_ids.device).expand(b, -1)
    inside = positions < (lengths.to(input_ids.device) - 1)[:, None]  # (b, l) a next token exists
    targets = torch.where(inside, F.pad(input_ids[:, 1:], (0, 1)), 0)  # (b, l) token t + 1, else 0
    padding = positions >= lengths.to(input_ids.device)[:, None]  # (b, l) right padding
    return ModelInputs(input_ids, positions, targets, lengths, width, padding=padding)


def packed_inputs(input_ids: torch.Tensor, lengths: torch.Tensor, pad_multiple: int = 1) -> ModelInputs:
    """Right-padded rows (b, l) packed into one THD row of sum(lengths) tokens (padded to
    ``pad_multiple``)."""
    p = pack_rows(input_ids, lengths, pad_multiple)
    cu = p.cu_seqlens  # (b+1,) or (b+2,) with a pad segment; int32 on the rows' device
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=p.max_seqlen, max_seqlen_kv=p.max_seqlen)
    padding = torch.arange(p.input_ids.size(1), device=cu.device)[None] >= cu[len(lengths)]  # (1, T) pad segment
    return ModelInputs(p.input_ids, p.position_ids, p.targets, lengths, input_ids.size(1),
                       starts=cu[:len(lengths)].long(), packed_seq_params=params, padding=padding)


def cp_packed_inputs(input_ids: torch.Tensor, lengths: torch.Tensor, group, cp: int, rank: int) -> ModelInputs:
    """This CP rank's slice of the packed row (megarl/models/context_parallel.py): every sequence
    padded to a multiple of 2·cp, chunks r and 2·cp-1-r of each; global cu_seqlens."""
    (ids, targets, positions, padding), cu, padded, index = cp_pack(input_ids, lengths, cp)
    layout = CPLayout(group, cp, rank, index, ids.size(1))
    span = int(padded.max())
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=span,
                             max_seqlen_kv=span)
    params.cp_index, params.cp_order = index, gather_order(index)  # for the attention's all-to-alls
    return ModelInputs(layout.local(ids), layout.local(positions), layout.local(targets), lengths,
                       input_ids.size(1), starts=cu[:-1].long(), packed_seq_params=params, cp=layout,
                       padding=layout.local(padding))
