"""Outcome advantages relative to a group of samples (GRPO, Dr.GRPO, RLOO).

Spec (`group_advantage_ref`). scores (B,) are per-sequence rewards, group_ids
(B,) arbitrary integers (need not be contiguous or sorted; equal id = same
prompt). For a sample in a group of n members with mean mu and unbiased std
sd = sqrt(sum (s - mu)^2 / (n - 1)):
    "grpo"    (s - mu) / (sd + eps)
    "drgrpo"  s - mu
    "rloo"    s - mean of the other n-1 members = n / (n - 1) * (s - mu)
A group of one sample gets 0 in every mode. The sequence advantage is then
broadcast over the response: out[b, t] = adv[b] * (mask[b, t] != 0). fp32 out.
("std" and "mean" are accepted as aliases of "grpo" and "drgrpo".)

Shifted data. Every path computes the deviations from a pivot p, a member of
the group: d_j = s_j - p, s - mu = d - mean(d), sd from the d - mean(d). A
group of identical scores then has d = 0 exactly, hence an advantage of
exactly 0 in every mode (the fp32 mean of n copies of a non-dyadic value
such as 0.7 is 1 ulp off, which divided by a ~1e-8 std gave up to ~0.6).
The ref computes in fp64 (scores rounded to fp32 first, as the kernels read
them) with the group's first member as pivot; torch uses the group minimum;
Triton uses each sample's own score s_i.

Kernels. No host sync and no id remapping: each program takes BLOCK_I
samples and streams all B (id, score) pairs in BLOCK_J tiles, matching ids
with an (BLOCK_I, BLOCK_J) equality tile (O(B^2) compares: 67M at B=8192, a
few microseconds of ALU) -- first for count and mean(s_j - s_i), then (grpo
only) for the sum of squared deviations. A second launch broadcasts over (B, T).
"""
import torch

from megarl_kernels.dispatch import choose, next_pow2, tl, triton

MODES = {"grpo": 0, "drgrpo": 1, "rloo": 2}
ALIASES = {"std": "grpo", "mean": "drgrpo"}

# Samples per program (BLOCK_I) and per streamed tile (BLOCK_J): a 32 x 128
# compare tile = 16 values per thread at 8 warps. Unswept (the stats launch
# is ~B^2/4096 tiles, small next to the (B, T) broadcast).
BLOCK_I, BLOCK_J = 32, 128
# Broadcast tile (rows x tokens): 8 x 512 fp32 = 16 KiB written per program. Unswept.
BCAST_B, BCAST_T = 8, 512


def _mode(mode: str) -> str:
    mode = ALIASES.get(mode, mode)
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; expected one of {sorted(MODES)} (or aliases {ALIASES})")
    return mode


def _finish(dev, var, n, mode: str, eps: float):
    """Sequence advantages (B,) from s - group mean, unbiased group var and size (all (B,))."""
    adv = {"grpo": lambda: dev / (var.sqrt() + eps), "drgrpo": lambda: dev,
           "rloo": lambda: dev * n / (n - 1).clamp_min(1)}[mode]()
    return torch.where(n > 1, adv, 0.0)


def group_advantage_ref(scores, group_ids, mask, mode: str = "grpo", eps: float = 1e-6):
    """The spec: a Python loop over groups, in fp64. (B,), (B,), (B, T) -> (B, T) fp32."""
    mode, s = _mode(mode), scores.float().double()
    dev, var, n = torch.zeros_like(s), torch.zeros_like(s), torch.zeros_like(s)
    for g in torch.unique(group_ids).tolist():
        sel = group_ids == g
        k = int(sel.sum())
        d = s[sel] - s[sel][0]  # pivot: the group's first member
        dev[sel] = d - d.mean()
        var[sel] = (dev[sel] ** 2).sum() / (k - 1) if k > 1 else 0.0
        n[sel] = k
    return _finish(dev, var, n, mode, eps).float()[:, None] * (mask != 0)


def group_advantage_torch(scores, group_ids, mask, mode: str = "grpo", eps: float = 1e-6):
    """Vectorized PyTorch: unique + index_add (one host sync in torch.unique)."""
    mode, s = _mode(mode), scores.float()
    _, inv = torch.unique(group_ids, return_inverse=True)  # (B,) in [0, G)
    G = int(inv.max()) + 1 if inv.numel() else 0
    cnt = s.new_zeros(G).index_add_(0, inv, torch.ones_like(s))  # (G,)
    pivot = s.new_full((G,), float("inf")).scatter_reduce_(0, inv, s, "amin")  # (G,) group minimum
    d = s - pivot[inv]  # (B,)
    dev = d - (s.new_zeros(G).index_add_(0, inv, d) / cnt)[inv]  # (B,) s - group mean
    var = (s.new_zeros(G).index_add_(0, inv, dev ** 2) / (cnt - 1).clamp_min(1))[inv]
    return _finish(dev, var, cnt[inv], mode, eps)[:, None] * (mask != 0)


@triton.jit
def _group_stats_kernel(score_ptr, gid_ptr, adv_ptr, B, eps,
                        MODE: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
    i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)  # (BI,)
    gi = tl.load(gid_ptr + i, mask=i < B)
    si = tl.load(score_ptr + i, mask=i < B, other=0.0).to(tl.float32)
    n = tl.zeros([BLOCK_I], dtype=tl.float32)
    total = tl.zeros([BLOCK_I], dtype=tl.float32)  # sum of s_j - s_i over i's group
    for j0 in range(0, B, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        gj = tl.load(gid_ptr + j, mask=j < B)
        sj = tl.load(score_ptr + j, mask=j < B, other=0.0).to(tl.float32)
        same = (gi[:, None] == gj[None, :]) & (j < B)[None, :]  # (BI, BJ)
        n += tl.sum(same.to(tl.float32), axis=1)
        total += tl.sum(tl.where(same, sj[None, :] - si[:, None], 0.0), axis=1)
    mean_d = total / tl.maximum(n, 1.0)  # group mean - s_i; exactly 0 for identical scores
    dev = -mean_d
    if MODE == 0:  # grpo: second sweep for the unbiased std
        sq = tl.zeros([BLOCK_I], dtype=tl.float32)
        for j0 in range(0, B, BLOCK_J):
            j = j0 + tl.arange(0, BLOCK_J)
            gj = tl.load(gid_ptr + j, mask=j < B)
            sj = tl.load(score_ptr + j, mask=j < B, other=0.0).to(tl.float32)
            same = (gi[:, None] == gj[None, :]) & (j < B)[None, :]
            d = (sj[None, :] - si[:, None]) - mean_d[:, None]  # (BI, BJ) s_j - group mean
            sq += tl.sum(tl.where(same, d * d, 0.0), axis=1)
        adv = dev / (tl.sqrt(sq / tl.maximum(n - 1.0, 1.0)) + eps)
    elif MODE == 1:  # drgrpo
        adv = dev
    else:  # rloo
        adv = dev * n / tl.maximum(n - 1.0, 1.0)
    tl.store(adv_ptr + i, tl.where(n > 1.0, adv, 0.0), mask=i < B)


@triton.jit
def _broadcast_kernel(adv_ptr, m_ptr, out_ptr, B, T, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)  # (BB,)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BT,)
    ok = (rows < B)[:, None] & (t < T)[None, :]
    off = rows.to(tl.int64)[:, None] * T + t[None, :]  # (BB, BT)
    a = tl.load(adv_ptr + rows, mask=rows < B, other=0.0)
    m = tl.load(m_ptr + off, mask=ok, other=0) != 0
    tl.store(out_ptr + off, tl.where(m, a[:, None], 0.0), mask=ok)


def group_advantage_triton(scores, group_ids, mask, mode: str = "grpo", eps: float = 1e-6):
    """Triton: one launch for the (B,) advantages, one for the (B, T) broadcast."""
    mode = _mode(mode)
    B, T = mask.shape
    m = mask.contiguous()
    m = m.view(torch.uint8) if m.dtype == torch.bool else m
    adv = torch.empty(B, dtype=torch.float32, device=mask.device)
    out = torch.empty(B, T, dtype=torch.float32, device=mask.device)
    if B == 0:
        return out
    _group_stats_kernel[(triton.cdiv(B, BLOCK_I),)](
        scores.contiguous(), group_ids.contiguous(), adv, B, float(eps),
        MODE=MODES[mode], BLOCK_I=BLOCK_I, BLOCK_J=BLOCK_J, num_warps=8)
    if T > 0:
        block_t = min(BCAST_T, next_pow2(T))
        grid = (triton.cdiv(B, BCAST_B), triton.cdiv(T, block_t))
        _broadcast_kernel[grid](adv, m, out, B, T, BLOCK_B=BCAST_B, BLOCK_T=block_t, num_warps=4)
    return out


def group_advantage(scores, group_ids, mask, mode: str = "grpo", eps: float = 1e-6, backend: str = "auto"):
    """Group-relative advantages broadcast to tokens; spec in the module docstring.

    scores: (B,) float; group_ids: (B,) int; mask: (B, T). Returns (B, T) fp32.
    """
    if scores.dim() != 1 or group_ids.shape != scores.shape or mask.dim() != 2 or mask.shape[0] != scores.shape[0]:
        raise ValueError(f"group_advantage wants scores (B,), group_ids (B,), mask (B, T); got "
                         f"{tuple(scores.shape)}, {tuple(group_ids.shape)}, {tuple(mask.shape)}")
    impl = {"triton": group_advantage_triton, "torch": group_advantage_torch,
            "ref": group_advantage_ref}[choose(backend, scores, group_ids, mask)]
    return impl(scores, group_ids, mask, mode, eps)
