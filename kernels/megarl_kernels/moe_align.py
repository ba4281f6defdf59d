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

`moe_align` is one Triton program on CUDA for up to `KERNEL_MAX_SLOTS` slots (`_moe_align_kernel`:
a decode step's MoE layer would otherwise spend a dozen small launches here), else device-side
torch (`moe_align_torch`: a scatter-add count, a stable argsort, cumsums, a searchsorted; no host
sync, no loop over experts; many programs, where one program's chunk loop would grow with T);
`moe_align_ref` is the spec, a loop over experts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl_kernels.dispatch import choose, next_pow2, tl, triton

# Slots up to which the one-program kernel lays them out (a decode batch of 128 tokens at top-8);
# above it the torch ops, whose time grows more slowly (bench_moe_kernels.py times both at each T;
# the kernel wins at 1,024 slots, the torch ops at 2,048: docs/performance.md).
KERNEL_MAX_SLOTS = 1024
FILL = 1024  # layout rows the kernel fills with the sentinel per step


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


def moe_align_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int, first_expert: int = 0) -> MoeAlignment:
    """(T, k) expert ids -> the padded layout (module docstring), in torch ops on topk_ids' device."""
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


@triton.jit
def _expert_hits(ids_ptr, s0, num_slots, num_experts, first_expert, CHUNK: tl.constexpr, E_PAD: tl.constexpr):
    """Slots [s0, s0 + CHUNK) -> their indices (CHUNK,) and one-hot (CHUNK, E_PAD) int32 of their
    local expert (all zero for padding and other ranks' slots)."""
    s = s0 + tl.arange(0, CHUNK)
    local = tl.load(ids_ptr + s, mask=s < num_slots, other=-1) - first_expert
    local = tl.where((s < num_slots) & (local >= 0) & (local < num_experts), local, -1)
    return s, (local[:, None] == tl.arange(0, E_PAD)[None, :]).to(tl.int32)


@triton.jit
def _moe_align_kernel(ids_ptr, sorted_ptr, block_experts_ptr, num_padded_ptr, num_slots, num_experts,
                      first_expert, rows, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
                      FILL: tl.constexpr):
    """One program: count each expert's slots, lay out the padded runs (cumsum), fill the layout
    with the padding sentinel, then place each slot at its run's start + the number of earlier slots
    of its expert, and give each block the expert whose run covers its first row."""
    counts = tl.zeros([E_PAD], tl.int32)
    for s0 in range(0, num_slots, CHUNK):
        _, hit = _expert_hits(ids_ptr, s0, num_slots, num_experts, first_expert, CHUNK, E_PAD)
        counts += tl.sum(hit, axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # (E_PAD,) 0 past num_experts
    ends = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, total)
    for r0 in range(0, rows, FILL):
        r = r0 + tl.arange(0, FILL)
        tl.store(sorted_ptr + r, tl.zeros([FILL], tl.int32) + num_slots, mask=r < rows)
    tl.debug_barrier()  # the padding is written before any slot overwrites it
    next_row = ends - padded  # (E_PAD,) where each expert's next slot goes
    for s0 in range(0, num_slots, CHUNK):
        s, hit = _expert_hits(ids_ptr, s0, num_slots, num_experts, first_expert, CHUNK, E_PAD)
        earlier = tl.cumsum(hit, axis=0) - hit  # (CHUNK, E_PAD) same-expert slots before this one in the chunk
        dest = tl.sum(hit * (next_row[None, :] + earlier), axis=1)
        tl.store(sorted_ptr + dest, s, mask=tl.sum(hit, axis=1) > 0)
        next_row += tl.sum(hit, axis=0)
    for b0 in range(0, rows // BLOCK_M, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        first_row = b * BLOCK_M
        expert = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), axis=1)  # runs ending at or before it
        tl.store(block_experts_ptr + b, tl.where(first_row < total, expert, -1), mask=b < rows // BLOCK_M)


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int, first_expert: int = 0) -> MoeAlignment:
    """The layout from `_moe_align_kernel`, one launch. Chunks of slots keep the (CHUNK, E_PAD) one-hot
    at 8,192 elements (64 slots at 128 experts)."""
    slots, rows = topk_ids.numel(), max_padded_rows(topk_ids.numel(), num_experts, block_m)
    ids = topk_ids.reshape(-1).to(torch.int32)
    sorted_slots = torch.empty(rows, dtype=torch.int32, device=ids.device)
    block_experts = torch.empty(rows // block_m, dtype=torch.int32, device=ids.device)
    num_padded = torch.empty(1, dtype=torch.int32, device=ids.device)
    e_pad = max(16, next_pow2(num_experts))
    _moe_align_kernel[(1,)](ids, sorted_slots, block_experts, num_padded, slots, num_experts, first_expert, rows,
                            BLOCK_M=block_m, E_PAD=e_pad, CHUNK=max(16, min(256, 8192 // e_pad)), FILL=FILL,
                            num_warps=8)
    return MoeAlignment(sorted_slots, block_experts, num_padded, block_m)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, first_expert: int = 0,
              backend: str = "auto") -> MoeAlignment:
    """(T, k) expert ids -> the padded layout (module docstring), on topk_ids' device. ``backend``
    "triton": the kernel up to `KERNEL_MAX_SLOTS` slots on CUDA (always under the interpreter)."""
    impl = choose(backend, topk_ids)
    if impl == "triton" and (topk_ids.numel() <= KERNEL_MAX_SLOTS or not topk_ids.is_cuda):
        return moe_align_triton(topk_ids, num_experts, block_m, first_expert)
    return (moe_align_ref if impl == "ref" else moe_align_torch)(topk_ids, num_experts, block_m, first_expert)
