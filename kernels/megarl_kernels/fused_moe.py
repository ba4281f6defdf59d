"""The experts of a mixture-of-experts layer in two grouped GEMM launches: each expert's SwiGLU MLP on its tokens.

Spec (`fused_moe_ref`). hidden x (T, H); w13 (E, 2F, H), each expert's fc1 [gate rows | up rows]
(HF's ``gate_up_proj``); w2 (E, H, F) (``down_proj``); topk_weights (T, k) fp32 and topk_ids (T, k)
from `moe_route`. For each token t and choice j with expert e:
    y_tj = F.linear(silu_mul(F.linear(x_t, w13[e])), w2[e])   every GEMM's fp32 sum rounded to x.dtype
    out_t = sum_j topk_weights[t, j] * y_tj                   in fp32 (j ascending), rounded once

Kernels. The T * k token slots are sorted by expert and each expert's run padded to BLOCK_M rows
(`moe_align.py`); one launch covers every block of every expert:
  1. gate/up: program (block, n) gathers its block's token rows of x, multiplies them by its expert's
     gate and up rows [n*BLOCK_N, +BLOCK_N) in two fp32 accumulators, and writes only their SwiGLU
     to the slots' rows of act (T*k, F) (the (T*k, 2F) fc1 output is never stored);
  2. down: program (block, n) multiplies the block's act rows by its expert's w2 rows, rounds to
     x.dtype, multiplies by the slot's routing weight and writes fp32 rows of (T*k, H);
then `_moe_sum_kernel` adds each token's k rows (fp32, j ascending: no atomics, the spec's order)
and rounds to x.dtype. With the layout's own launch (`moe_align`) a layer is four launches. The
grids have a fixed size for a given (T, k, E) (`max_padded_rows`), so decode steps replay in a
CUDA graph; blocks past the used rows return at once.

Expert parallelism (`fused_moe_local`): a rank holding experts [e0, e0 + E_local) computes the
sum over only the choices that fall in its range; the sum over the EP group of every rank's
result is the layer's output (up to the rounding of the partial sums to x.dtype).

Weights may be any strided views (each GEMM takes all three strides), e.g. megatron's GroupedMLP
``weight1`` (H, E * 2F) seen as (E, 2F, H) without a copy; the weight loads are coalesced along
whichever of H or the rows has stride 1.

CPU path (`fused_moe_torch`): slots sorted by expert into an (E, max count, H) zero-padded batch,
two ``torch.bmm`` and `silu_mul` between them; no loop over tokens or experts. It is
differentiable (autograd through the index writes and the GEMMs), to hidden, both weights and the
routing weights; the Triton path is forward only (rollout).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megarl_kernels.dispatch import choose, next_pow2, tl, triton
from megarl_kernels.moe_align import local_experts, moe_align
from megarl_kernels.paged_decode import f32_dot
from megarl_kernels.swiglu import silu_mul_ref, silu_mul_rounded

# (BLOCK_N, BLOCK_K, num_warps, num_stages) of both GEMM launches, by BLOCK_M. Chosen by
# `benchmarks/bench_moe_kernels.py --sweep` on the Qwen3-30B-A3B expert shape (H 2048, F 768,
# 128 experts, top-8) at 32-2,048 tokens; the table is in docs/performance.md. Deeper K tiles pay
# while blocks are short (decode: few slots an expert, the weight stream is the cost); at BLOCK_M 64
# they spill shared memory's budget. Other shapes get the same rule, narrowed by `_tile` where a
# dimension is smaller than the tile; results do not depend on the tiles (the tests vary them).
SHORT_BLOCK_TILES = (64, 128, 4, 3)  # BLOCK_M 16 / 32
LONG_BLOCK_TILES = (64, 64, 4, 3)  # BLOCK_M 64
SUM_BLOCK = 1024  # hidden columns per program of the sum over k


def launch_tiles(block_m: int):
    """The GEMM launches' tiles for blocks of `block_m` rows."""
    return SHORT_BLOCK_TILES if block_m <= 32 else LONG_BLOCK_TILES


def block_rows(num_slots: int, num_experts: int) -> int:
    """BLOCK_M from the average slots an expert gets: 16 (tl.dot's least) up to 8, 32 up to 32, else 64;
    a decode batch gives each expert a few slots, so most of a larger block would be padding (same sweep)."""
    per_expert = num_slots / max(num_experts, 1)
    return 16 if per_expert <= 8 else 32 if per_expert <= 32 else 64


def fused_moe_ref(hidden, w13, w2, topk_weights, topk_ids, first_expert: int = 0):
    """The spec (module docstring), token by token; choices outside [first_expert, + E) add nothing."""
    (t_count, h), k = hidden.shape, topk_ids.shape[1]
    out = torch.zeros(t_count, h, dtype=torch.float32, device=hidden.device)
    for t in range(t_count):
        for j in range(k):
            e = int(topk_ids[t, j]) - first_expert
            if 0 <= e < w13.shape[0]:
                act = silu_mul_ref(F.linear(hidden[t:t + 1], w13[e]))  # (1, F)
                out[t] += topk_weights[t, j].float() * F.linear(act, w2[e])[0].float()
    return out.to(hidden.dtype)


def fused_moe_torch(hidden, w13, w2, topk_weights, topk_ids, first_expert: int = 0):
    """Vectorized spec: every expert's slots padded to the largest count, two batched GEMMs."""
    (t_count, h), (e_count, k) = hidden.shape, (w13.shape[0], topk_ids.shape[1])
    key = local_experts(topk_ids, e_count, first_expert)  # (S,), E = another rank's
    slots = torch.nonzero(key < e_count).squeeze(1)  # (M,) the slots computed here
    expert, order = torch.sort(key[slots], stable=True)
    slots = slots[order]
    counts = torch.bincount(expert, minlength=e_count)  # (E,)
    rank = torch.arange(len(slots), device=hidden.device) - (counts.cumsum(0) - counts)[expert]
    x = hidden.new_zeros(e_count, int(counts.max()) if len(slots) else 0, h)  # (E, C, H)
    x[expert, rank] = hidden[slots // k]
    act = silu_mul_ref(torch.bmm(x, w13.transpose(1, 2)))  # (E, C, F)
    y = torch.bmm(act, w2.transpose(1, 2))[expert, rank]  # (M, H)
    contrib = torch.zeros(t_count * k, h, dtype=torch.float32, device=hidden.device)
    contrib[slots] = y.float() * topk_weights.reshape(-1)[slots, None].float()
    return contrib.view(t_count, k, h).sum(1).to(hidden.dtype)


@triton.jit
def _program_block(sorted_slots_ptr, num_padded_ptr, num_n, BLOCK_M: tl.constexpr):
    """This program's (block, column tile), whether its block is in use, and its slots (BLOCK_M,)."""
    pid = tl.program_id(0)
    pid_m, pid_n = pid // num_n, pid % num_n
    used = pid_m * BLOCK_M < tl.load(num_padded_ptr)
    slots = tl.load(sorted_slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return pid_m, pid_n, used, slots


@triton.jit
def _moe_gate_up_kernel(x_ptr, w_ptr, act_ptr, sorted_slots_ptr, block_experts_ptr, num_padded_ptr, num_slots,
                        F, K, stride_xt, stride_xk, stride_we, stride_wn, stride_wk, stride_at,
                        TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        F32_DOT: tl.constexpr):
    """act[slot, n] = silu(x[slot // k] . w[e, n]) * (x[slot // k] . w[e, F + n]) for the block's slots."""
    pid_m, pid_n, used, slots = _program_block(sorted_slots_ptr, num_padded_ptr, tl.cdiv(F, BLOCK_N), BLOCK_M)
    if used:
        expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
        real = slots < num_slots  # (BM,) padding rows hold num_slots
        tokens = (slots // TOP_K).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + tokens[:, None] * stride_xt + ks[None, :] * stride_xk  # (BM, BK)
        wg_ptrs = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk
        wu_ptrs = wg_ptrs + F * stride_wn  # (BK, BN) the up rows
        gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = ks < K - k0
            x = tl.load(x_ptrs, mask=real[:, None] & k_ok[None, :], other=0.0)
            w_ok = k_ok[:, None] & (cols[None, :] < F)
            wg = tl.load(wg_ptrs, mask=w_ok, other=0.0)
            wu = tl.load(wu_ptrs, mask=w_ok, other=0.0)
            if F32_DOT:  # the CPU interpreter multiplies bf16's raw bits (`f32_dot`)
                x, wg, wu = x.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
            gate = tl.dot(x, wg, gate, input_precision="ieee")
            up = tl.dot(x, wu, up, input_precision="ieee")
            x_ptrs += BLOCK_K * stride_xk
            wg_ptrs += BLOCK_K * stride_wk
            wu_ptrs += BLOCK_K * stride_wk
        act = silu_mul_rounded(gate, up, act_ptr.dtype.element_ty)
        ptrs = act_ptr + slots[:, None].to(tl.int64) * stride_at + cols[None, :]
        tl.store(ptrs, act, mask=real[:, None] & (cols[None, :] < F))


@triton.jit
def _moe_down_kernel(act_ptr, w_ptr, weights_ptr, out_ptr, sorted_slots_ptr, block_experts_ptr, num_padded_ptr,
                     num_slots, N, K, stride_at, stride_we, stride_wn, stride_wk, stride_ot,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr):
    """out[slot, n] = weight[slot] * round(act[slot] . w[e, n]) in fp32, for the block's slots."""
    pid_m, pid_n, used, slots = _program_block(sorted_slots_ptr, num_padded_ptr, tl.cdiv(N, BLOCK_N), BLOCK_M)
    if used:
        expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
        real = slots < num_slots
        rows = slots.to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = act_ptr + rows[:, None] * stride_at + ks[None, :]  # (BM, BK)
        w_ptrs = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = ks < K - k0
            a = tl.load(a_ptrs, mask=real[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & (cols[None, :] < N), other=0.0)
            if F32_DOT:
                a, w = a.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision="ieee")
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
        weight = tl.load(weights_ptr + slots, mask=real, other=0.0)  # (BM,) fp32
        y = acc.to(act_ptr.dtype.element_ty).to(tl.float32) * weight[:, None]  # F.linear's rounding first
        tl.store(out_ptr + rows[:, None] * stride_ot + cols[None, :], y, mask=real[:, None] & (cols[None, :] < N))


@triton.jit
def _moe_sum_kernel(contrib_ptr, ids_ptr, out_ptr, H, num_experts, first_expert, stride_ct, stride_ot,
                    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t] = sum over j ascending of contrib[t*k + j] in fp32, rounded; choices of other ranks'
    experts add nothing (their rows of contrib were never written)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j in tl.static_range(TOP_K):
        local = tl.zeros([BLOCK_H], tl.int32) + tl.load(ids_ptr + t * TOP_K + j) - first_expert  # (BLOCK_H,) equal
        mine = (cols < H) & (local >= 0) & (local < num_experts)
        acc += tl.load(contrib_ptr + (t * TOP_K + j) * stride_ct + cols, mask=mine, other=0.0)
    tl.store(out_ptr + t * stride_ot + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < H)


def _tile(tiles, n: int, k: int):
    """The launch's (BLOCK_N, BLOCK_K, warps, stages), narrowed to small problems (>= 16 for tl.dot)."""
    block_n, block_k, warps, stages = tiles
    return min(block_n, max(16, next_pow2(n))), min(block_k, max(16, next_pow2(k))), warps, stages


def fused_moe_triton(hidden, w13, w2, topk_weights, topk_ids, first_expert: int = 0,
                     block_m: int | None = None, gate_up_tiles=None, down_tiles=None):
    """The launches of the module docstring for w13 / w2 holding experts [first_expert, + E); other
    choices add nothing. Tiles default to `block_rows` and `launch_tiles` (the tests
    pass small ones)."""
    (t_count, h), (e_count, f2, _), k = hidden.shape, w13.shape, topk_ids.shape[1]
    f, slots = f2 // 2, t_count * k
    block_m = block_m or block_rows(slots, e_count)
    ids = topk_ids.reshape(-1).to(torch.int32)  # (S,)
    align = moe_align(ids, e_count, block_m, first_expert, backend="triton")
    blocks = align.sorted_slots.numel() // block_m
    weights = topk_weights.reshape(-1).float().contiguous()  # (S,)
    act = hidden.new_empty(slots, f)  # rows of other ranks' slots stay unwritten and unread
    contrib = torch.empty(slots, h, dtype=torch.float32, device=hidden.device)  # (S, H) weighted expert outputs
    out = hidden.new_empty(t_count, h)
    dot32 = f32_dot(hidden.dtype)
    if blocks and slots:
        bn, bk, warps, stages = _tile(gate_up_tiles or launch_tiles(block_m), f, h)
        _moe_gate_up_kernel[(blocks * triton.cdiv(f, bn),)](
            hidden, w13, act, align.sorted_slots, align.block_experts, align.num_padded, slots, f, h,
            hidden.stride(0), hidden.stride(1), w13.stride(0), w13.stride(1), w13.stride(2), act.stride(0),
            TOP_K=k, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, F32_DOT=dot32, num_warps=warps, num_stages=stages)
        bn, bk, warps, stages = _tile(down_tiles or launch_tiles(block_m), h, f)
        _moe_down_kernel[(blocks * triton.cdiv(h, bn),)](
            act, w2, weights, contrib, align.sorted_slots, align.block_experts, align.num_padded, slots, h, f,
            act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), contrib.stride(0),
            BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, F32_DOT=dot32, num_warps=warps, num_stages=stages)
        block_h = min(SUM_BLOCK, next_pow2(h))
        _moe_sum_kernel[(t_count, triton.cdiv(h, block_h))](
            contrib, ids, out, h, e_count, first_expert, contrib.stride(0), out.stride(0), TOP_K=k,
            BLOCK_H=block_h, num_warps=4)
    return out


def _check_shapes(name, hidden, w13, w2, topk_weights, topk_ids):
    ok = (hidden.dim() == 2 and w13.dim() == 3 and w2.dim() == 3 and w13.shape[1] % 2 == 0
          and w13.shape[2] == hidden.shape[1] and w2.shape == (w13.shape[0], hidden.shape[1], w13.shape[1] // 2)
          and topk_ids.dim() == 2 and topk_weights.shape == topk_ids.shape and topk_ids.shape[0] == hidden.shape[0])
    if not ok:
        raise ValueError(f"{name}: hidden (T, H), w13 (E, 2F, H), w2 (E, H, F), topk_weights and topk_ids (T, k) "
                         f"expected; got {tuple(hidden.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}, "
                         f"{tuple(topk_weights.shape)}, {tuple(topk_ids.shape)}")
    if hidden.stride(-1) != 1:
        raise ValueError(f"{name}: hidden must have dense rows (stride 1 in its last dim)")


def fused_moe(hidden, w13, w2, topk_weights, topk_ids, backend: str = "auto"):
    """(T, H) hidden, (E, 2F, H) w13, (E, H, F) w2, (T, k) routing -> (T, H) sum over each token's
    k experts of weight * expert MLP (module docstring); an id outside [0, E) adds nothing."""
    _check_shapes("fused_moe", hidden, w13, w2, topk_weights, topk_ids)
    impl = choose(backend, hidden, w13, w2, topk_weights, topk_ids)
    if impl == "triton":
        return fused_moe_triton(hidden, w13, w2, topk_weights, topk_ids)
    return (fused_moe_ref if impl == "ref" else fused_moe_torch)(hidden, w13, w2, topk_weights, topk_ids)


def fused_moe_local(hidden, w13, w2, topk_weights, topk_ids, first_expert: int, backend: str = "auto"):
    """Expert parallelism: this rank's share of `fused_moe` when it holds experts [first_expert,
    first_expert + E) of w13 / w2 (E, ...) and topk_ids are global ids. Summed over the EP group's
    ranks (which together hold every expert once), the shares give the layer's output."""
    _check_shapes("fused_moe_local", hidden, w13, w2, topk_weights, topk_ids)
    impl = choose(backend, hidden, w13, w2, topk_weights, topk_ids)
    if impl == "triton":
        return fused_moe_triton(hidden, w13, w2, topk_weights, topk_ids, first_expert=first_expert)
    return (fused_moe_ref if impl == "ref" else fused_moe_torch)(hidden, w13, w2, topk_weights, topk_ids, first_expert)
