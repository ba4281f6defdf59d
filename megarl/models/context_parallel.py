"""Ulysses context parallelism on megatron-core's CP group: each CP rank holds a slice of every sequence.

Layout (megatron's load-balanced one, which its THD RoPE expects): every
sequence of a packed row is padded (token 0, after its real tokens) to a
multiple of 2·cp and cut into 2·cp equal chunks; CP rank r keeps chunks r and
2·cp-1-r of each sequence, so every rank gets the same number of tokens and
an equal share of the causal attention work. ``PackedSeqParams`` keep the
global (padded) ``cu_seqlens``; the model's inputs are the rank's slice.

    attention (megarl/models/sdpa_attention.py): [t, heads, d] slices ->
        all-to-all over CP -> [T, heads / cp, d], all tokens in sequence order ->
        attention per sequence -> back to [t, heads, d]
    heads (``ModelInputs.to_rows`` / ``at_last_token``): the per-position numbers
        of every rank are gathered into the global row (backward: each rank
        keeps the gradient of its own positions), so losses, values and scores
        are computed from whole sequences, the same on every CP rank.

The schedule's token count is reported by CP rank 0 only: megatron all-reduces
counts and gradients over dp x cp, so the gradient is that of the CP1 loss.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.nn.functional import all_to_all_single


@dataclass
class CPLayout:
    """Where each CP rank's tokens sit in the global packed row."""

    group: dist.ProcessGroup
    size: int
    rank: int
    index: torch.Tensor  # (cp, t) long: global position of token k of CP rank j
    total: int  # T: tokens of the global (padded) row

    def local(self, row: torch.Tensor) -> torch.Tensor:
        """(1, T, ...) global -> (1, t, ...) this rank's slice."""
        return row[:, self.index[self.rank].to(row.device)]

    def gather(self, per_position: torch.Tensor) -> torch.Tensor:
        """(1, t, ...) this rank's numbers -> (1, T, ...) every rank's, in global order."""
        return _GatherRow.apply(per_position, self)


class _GatherRow(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, layout: CPLayout):
        ctx.layout = layout
        parts = [torch.empty_like(local) for _ in range(layout.size)]
        dist.all_gather(parts, local.contiguous(), group=layout.group)
        stacked = torch.cat(parts, dim=1)  # (1, cp * t, ...) by rank
        out = local.new_empty((1, layout.total) + tuple(local.shape[2:]))
        out[:, layout.index.reshape(-1).to(local.device)] = stacked
        return out

    @staticmethod
    def backward(ctx, grad):
        return ctx.layout.local(grad), None


def cp_pack(input_ids: torch.Tensor, lengths: torch.Tensor, cp: int):
    """Right-padded rows (B, L) -> global (ids, targets, positions, padding) (1, T) with each
    sequence padded to a multiple of 2·cp (padding: bool, True at those added tokens), its
    cu_seqlens (B+1,) int32, padded lengths (B,) and the (cp, T / cp) index of every rank's chunks."""
    dev, (b, width) = input_ids.device, input_ids.shape
    lengths = lengths.to(dev, torch.int64)
    chunks = 2 * cp
    padded = (lengths + chunks - 1) // chunks * chunks  # (B,)
    span = int(padded.max())
    cols = torch.arange(span, device=dev)
    grid = F.pad(input_ids, (0, max(span - width, 0)))[:, :span]  # (B, span)
    real = cols < lengths[:, None]
    ids = torch.where(real, grid, 0)
    nxt = torch.where(cols < lengths[:, None] - 1, F.pad(ids[:, 1:], (0, 1)), 0)
    keep = cols < padded[:, None]  # (B, span): the padded slots
    flat = [t[keep].view(1, -1) for t in (ids, nxt, cols.expand(b, -1), ~real)]
    cu = F.pad(torch.cumsum(padded, 0), (1, 0))  # (B+1,)
    return flat, cu.to(torch.int32), padded, chunk_index(cu, cp)


def chunk_index(cu, cp: int) -> torch.Tensor:
    """(cp, T / cp) long: rank r's tokens are chunks r and 2cp-1-r of each sequence, in order.
    cu: (n + 1,) cumulative sequence lengths, each a multiple of 2·cp."""
    cu = torch.as_tensor(cu, dtype=torch.long).cpu()
    lengths = cu[1:] - cu[:-1]
    total = int(cu[-1])
    seq = torch.repeat_interleave(torch.arange(len(lengths)), lengths)  # (T,) sequence of each token
    chunk = (torch.arange(total) - cu[:-1][seq]) // (lengths[seq] // (2 * cp))  # (T,) 0 .. 2cp-1
    owner = torch.where(chunk < cp, chunk, 2 * cp - 1 - chunk)
    return torch.argsort(owner, stable=True).view(cp, total // cp)  # stable: global order per rank


def gather_order(index: torch.Tensor) -> torch.Tensor:
    """(T,) long: the position in the rank-by-rank concatenation of each global token."""
    order = torch.empty(index.numel(), dtype=torch.long)
    order[index.reshape(-1)] = torch.arange(index.numel())
    return order


# ---- the attention's all-to-alls ----

def seq_to_heads(x: torch.Tensor, order: torch.Tensor, group, cp: int) -> torch.Tensor:
    """[t, H, d] this rank's tokens, all heads -> [T, H / cp, d] every token in global order, this
    rank's heads. order: `gather_order` of the layout."""
    t, h, d = x.shape
    send = x.reshape(t, cp, h // cp, d).transpose(0, 1).contiguous()  # (cp, t, H/cp, d): chunk j to rank j
    recv = all_to_all_single(torch.empty_like(send), send, group=group)  # (cp, t, H/cp, d): from rank j
    return recv.reshape(cp * t, h // cp, d).index_select(0, order.to(x.device))


def heads_to_seq(y: torch.Tensor, index: torch.Tensor, group, cp: int) -> torch.Tensor:
    """The inverse of `seq_to_heads`: [T, H / cp, d] -> [t, H, d]."""
    total, hp, d = y.shape
    t = total // cp
    send = y.index_select(0, index.reshape(-1).to(y.device)).reshape(cp, t, hp, d)  # rank j's tokens
    recv = all_to_all_single(torch.empty_like(send), send, group=group)  # (cp, t, H/cp, d): head group j
    return recv.transpose(0, 1).reshape(t, cp * hp, d)
