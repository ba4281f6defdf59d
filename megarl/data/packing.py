"""Token-budget micro-batching and packed (THD) inputs.

    bins = pack_sequences([len(s) for s in seqs], max_tokens=4096)
    for idx in bins:
        packed = build_packed_inputs([seqs[i] for i in idx])
        # packed.input_ids (1, T), packed.cu_seqlens (n+1,) int32

Packed layout: sequences are concatenated along one row, `cu_seqlens[k]` is
the start of sequence k (cu_seqlens[0] = 0, cu_seqlens[n] = T), and
`position_ids` restart at 0 at every sequence start. `targets[t]` is the token
after t in the same sequence (0 after a sequence's last token), so a
next-token head never reads across a boundary. `pack_rows` packs right-padded
(B, L) rows; its `pad_multiple` appends one padding segment (its own entry in
cu_seqlens, never attended to by a real token) so T divides, e.g., the TP size
under sequence parallelism.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F


def pack_sequences(lengths: Sequence[int], max_tokens: int, min_bins: int = 1) -> list[list[int]]:
    """First-fit-decreasing bins of indices whose lengths sum to <= max_tokens.

    Every index appears in exactly one bin. Bins come in creation order and
    list their indices longest first. `min_bins` splits the fullest bins until
    there are at least that many (so all DP ranks can run the same number of
    micro-batches: all-reduce max of len(bins), then call again with it).
    """
    if max_tokens <= 0:
        raise ValueError(f"pack_sequences: max_tokens={max_tokens}; set a positive token budget")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        n = lengths[i]
        if n < 0 or n > max_tokens:
            raise ValueError(f"pack_sequences: sequence {i} has {n} tokens, outside [0, max_tokens={max_tokens}]; "
                             "raise the micro-batch token budget to at least the longest sequence")
        for b, load in enumerate(loads):
            if load + n <= max_tokens:
                bins[b].append(i)
                loads[b] += n
                break
        else:
            bins.append([i])
            loads.append(n)
    return _split_to(bins, lengths, min_bins)


def _split_to(bins: list[list[int]], lengths: Sequence[int], min_bins: int) -> list[list[int]]:
    """Halve the heaviest multi-item bin until there are min_bins bins."""
    while len(bins) < min_bins:
        splittable = [b for b in range(len(bins)) if len(bins[b]) > 1]
        if not splittable:
            raise ValueError(f"pack_sequences: {sum(map(len, bins))} sequences cannot fill "
                             f"min_bins={min_bins} micro-batches; use fewer micro-batches or more samples")
        b = max(splittable, key=lambda k: (sum(lengths[i] for i in bins[k]), -k))
        items = bins[b]
        bins[b] = items[0::2]
        bins.append(items[1::2])
    return bins


@dataclass
class PackedInputs:
    """Sequences concatenated into one row, with their boundaries."""

    input_ids: torch.Tensor  # (1, T) int64
    position_ids: torch.Tensor  # (1, T) int64, restarts at 0 per sequence
    cu_seqlens: torch.Tensor  # (n+1,) int32, cumulative lengths starting at 0 (n+2 with a pad segment)
    max_seqlen: int  # longest segment, for flash/TE attention
    targets: torch.Tensor  # (1, T) int64, next token of the same sequence; 0 at each last token

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens.numel() - 1


def build_packed_inputs(seqs: Sequence[Sequence[int]]) -> PackedInputs:
    """Pack token id lists; no padding is added (T = sum of lengths)."""
    if not seqs:
        raise ValueError("build_packed_inputs: got no sequences; pass at least one")
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.int64)  # (n,)
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lens, 0)  # (n+1,)
    total = int(cu[-1])
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.int64)  # (T,)
    starts = torch.repeat_interleave(cu[:-1], lens)  # (T,) start of each token's sequence
    pos = torch.arange(total, dtype=torch.int64) - starts  # (T,)
    return PackedInputs(input_ids=ids.view(1, total), position_ids=pos.view(1, total),
                        cu_seqlens=cu.to(torch.int32), max_seqlen=int(lens.max()),
                        targets=_next_in_sequence(ids, cu).view(1, total))


def _next_in_sequence(ids: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """ids (T,) -> (T,): ids shifted left by one, 0 at every sequence's last token."""
    nxt = torch.zeros_like(ids)
    nxt[:-1] = ids[1:]
    last = cu[1:].long() - 1  # (n,)
    nxt[last[last >= 0]] = 0
    return nxt


def pack_rows(input_ids: torch.Tensor, lengths: torch.Tensor, pad_multiple: int = 1) -> PackedInputs:
    """Right-padded rows (B, L) with ``lengths`` (B,) -> one row of T = sum(lengths) tokens,
    plus a padding segment of token 0 up to a multiple of ``pad_multiple``. Stays on the rows' device."""
    dev, (b, width) = input_ids.device, input_ids.shape
    lengths = lengths.to(dev, torch.int64)
    if b == 0 or int(lengths.min()) < 1 or int(lengths.max()) > width:
        raise ValueError(f"pack_rows: lengths must be in [1, {width}] for {b} > 0 rows")
    cols = torch.arange(width, device=dev)
    real = cols < lengths[:, None]  # (B, L)
    shifted = torch.cat([input_ids[:, 1:], input_ids.new_zeros(b, 1)], dim=1)  # (B, L) token t+1
    nxt = torch.where(cols < lengths[:, None] - 1, shifted, 0)  # (B, L) 0 at each last token
    ids, targets, pos = input_ids[real], nxt[real], cols.expand(b, -1)[real]  # (T,) each, row-major
    pad = -ids.numel() % pad_multiple
    seg = [lengths] + ([lengths.new_tensor([pad])] if pad else [])
    cu = F.pad(torch.cumsum(torch.cat(seg), 0), (1, 0)).to(torch.int32)  # (B+1,) or (B+2,)
    if pad:
        zeros = ids.new_zeros(pad)
        ids, targets = torch.cat([ids, zeros]), torch.cat([targets, zeros])
        pos = torch.cat([pos, torch.arange(pad, device=dev)])
    total = ids.numel()
    return PackedInputs(input_ids=ids.view(1, total), position_ids=pos.view(1, total), cu_seqlens=cu,
                        max_seqlen=max(int(lengths.max()), pad), targets=targets.view(1, total))


def unpack(packed: torch.Tensor, cu_seqlens: torch.Tensor) -> list[torch.Tensor]:
    """Split a packed (1, T, ...) or (T, ...) tensor back into per-sequence tensors."""
    total = int(cu_seqlens[-1])
    if packed.dim() > 1 and packed.shape[0] == 1 and packed.shape[1] == total:
        packed = packed[0]  # (1, T, ...) -> (T, ...)
    if packed.shape[0] != total:
        raise ValueError(f"unpack: cu_seqlens ends at {total} but the tensor has shape {tuple(packed.shape)}; "
                         "pass the cu_seqlens of this packed batch")
    bounds = cu_seqlens.tolist()
    return [packed[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
