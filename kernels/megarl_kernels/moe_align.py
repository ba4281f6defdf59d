"""Token slots sorted by expert, each expert's run padded to whole blocks: the fused MoE's layout.

A token's j-th choice is slot s = t * k + j of the flat ``topk_ids`` (S = T * k slots). The fused
MoE kernels (`fused_moe.py`) compute blocks of BLOCK_M rows that all use one expert's weights, so
the slots are laid out expert by expert (experts ascending; an expert's slots in slot order), each
expert's run padded with the sentinel S to a multiple of BLOCK_M:

    sorted_slots   (P,) int32   slot of each row of the layout; S on padding rows and past the end
    block_experts  (P / BLOCK_M,) int32   the expert of each block; -1 for blocks past the end
    num_padded     (1,) int32   rows in use: sum over experts of their count rounded up to BLOCK_M

P = `max_padded_rows` depends only on (S, E, BLOCK_M), so the layout, and the kernels' grids that
cover it, have fixed shapes (a CUDA graph replays them); blocks at or past ``num_padded`` exit.

Expert parallelism: with ``first_expert`` = e0 and E = this rank's expert count, only slots whose
expert is in [e0, e0 + E) are laid out, under their local index (expert - e0); the other slots
appear nowhere.

`moe_align` is device-side torch (a scatter-add count, a stable argsort, cumsums, a searchsorted:
no host sync, no loop over experts); `moe_align_ref` is the spec, a loop over experts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MoeAlignment:
    sorted_slots: torch.Tensor  # (P,) int32 slot t*k+j of each row; S (= T*k) on padding rows
    block_experts: torch.Tensor  # (P // block_m,) int32 local expert of each block; -1 past num_padded
    num_padded: torch.Tensor  # (1,) int32 rows in use (a multiple of block_m)
    block_m: int  # rows per block


def max_padded_rows(num_slots: int, num_experts: int, block_m: int) -> int:
    """Rows the layout needs at most: every slot, plus up to block_m - 1 padding rows for each
    expert that has a slot (at most min(S, E) of them), rounded up to a whole block."""
    rows = num_slots + min(num_slots, num_experts) * (block_m - 1)
    return -(-rows // block_m) * block_m


def local_experts(topk_ids: torch.Tensor, num_experts: int, first_expert: int) -> torch.Tensor:
    """(T, k) global expert ids -> (S,) int64 local ids in [0, E), or E for slots of other ranks."""
    local = topk_ids.reshape(-1).long() - first_expert
    return torch.where((local >= 0) & (local < num_experts), local, num_experts)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, first_expert: int = 0) -> MoeAlignment:
    """(T, k) expert ids -> the padded layout (module docstring), on topk_ids' device."""
    dev, slots = topk_ids.device, topk_ids.numel()
    rows = max_padded_rows(slots, num_experts, block_m)
    key = local_experts(topk_ids, num_experts, first_expert)  # (S,); E = not this rank's
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev).scatter_add_(
        0, key, torch.ones_like(key))  # (E + 1,), the last one uncounted
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m  # (E,)
    padded_end = padded.cumsum(0)  # (E,) one past each expert's last row
    row_start = torch.cat([padded_end - padded, padded_end.new_zeros(1)])  # (E + 1,) first row of each run
    slot_start = counts.cumsum(0) - counts  # (E + 1,) first sorted position of each expert's slots
    order = torch.argsort(key, stable=True)  # (S,) slots by expert, in slot order within one
    expert_of = key[order]
    rank = torch.arange(slots, device=dev) - slot_start[expert_of]  # position within its expert's run
    sorted_slots = torch.full((rows + 1,), slots, dtype=torch.int32, device=dev)
    dest = torch.where(expert_of < num_experts, row_start[expert_of] + rank, rows)  # other ranks' -> row P
    sorted_slots.scatter_(0, dest, order.to(torch.int32))
    block_first_row = torch.arange(0, rows, block_m, device=dev)  # (P / block_m,)
    block_experts = torch.searchsorted(padded_end, block_first_row, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1).to(torch.int32)
    num_padded = padded_end[-1:].to(torch.int32) if num_experts else torch.zeros(1, dtype=torch.int32, device=dev)
    return MoeAlignment(sorted_slots[:rows], block_experts, num_padded, block_m)


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int, first_expert: int = 0) -> MoeAlignment:
    """The spec: for each expert in order, its slots in slot order, then padding to a whole block."""
    flat = topk_ids.reshape(-1).tolist()
    slots = len(flat)
    rows = max_padded_rows(slots, num_experts, block_m)
    layout, experts = [], []
    for e in range(num_experts):
        mine = [s for s, expert in enumerate(flat) if expert - first_expert == e]
        pad = -len(mine) % block_m
        layout += mine + [slots] * pad
        experts += [e] * ((len(mine) + pad) // block_m)
    used = len(layout)
    layout += [slots] * (rows - used)
    experts += [-1] * (rows // block_m - len(experts))
    as_int = dict(dtype=torch.int32, device=topk_ids.device)
    return MoeAlignment(torch.tensor(layout, **as_int), torch.tensor(experts, **as_int),
                        torch.tensor([used], **as_int), block_m)
