"""Generalized advantage estimation over (B, T) response tokens, mask-aware.

Spec (`gae_ref`). Positions with mask 0 are *skipped*: they get 0 in both
outputs and the recursion carries its state across them (as verl's masked GAE
does), so a real token bootstraps from the next *real* token. Walking t
backwards over real tokens, with v' and A' the value and advantage of the next
real token after t (0 if there is none):
    delta_t = r_t + gamma * v' - v_t
    A_t     = delta_t + gamma * lam * A'
    R_t     = A_t + v_t                       (returns, before whitening)
whiten=True replaces A by (A - mean) / sqrt(var + 1e-8), mean and unbiased var
over all real tokens of the batch (n <= 1 real tokens: var = 0), and 0 again at
masked positions. Accumulation is fp32; outputs are fp32.

Kernel. Both recursions are linear, x_t = d_t + c_t * x_{t+1}, so each is an
associative scan over pairs (c, d) with (c1, d1) then (c2, d2) composing to
(c1*c2, d2 + c2*d1):
    next value   nv_t = m_{t+1} ? v_{t+1} : nv_{t+1}    (c = 1 - m_{t+1}, d = m_{t+1} v_{t+1})
    advantage    A_t  = m_t ? delta_t + gamma lam A_{t+1} : A_{t+1}
One program owns BLOCK_B rows and walks T backwards in BLOCK_T chunks, loading
each chunk in reversed time order (coalesced: a reversed contiguous run) so a
forward `tl.associative_scan` runs backwards in time; the last element of a
chunk's scan is the carry into the next (earlier) chunk. At T <= BLOCK_T a row
is one load, one scan, one store.
"""
import torch

from megarl.kernels.dispatch import choose, next_pow2, tl, triton

WHITEN_EPS = 1e-8

# Elements per program tile (BLOCK_B * BLOCK_T). 2048: a whole T=2048 row per
# program -> B=512 gives 512 programs for 132 SMs with no loop-carried latency.
# Not yet swept on H200: `benchmarks/bench_kernels.py` sweeps 1024/2048/4096.
TILE = 2048
# Warps per program: 4 (16 fp32 per thread at TILE=2048). Unswept, see TILE.
NUM_WARPS = 4


def gae_ref(rewards, values, mask, gamma: float, lam: float, whiten: bool = False):
    """The spec: a Python loop over t, vectorized over B. (B, T) x3 -> ((B, T), (B, T)) fp32."""
    r, v, real = rewards.float(), values.float(), mask.bool()
    B, T = v.shape
    adv = torch.zeros_like(v)
    next_v = v.new_zeros(B)  # (B,) value of the next real token
    next_a = v.new_zeros(B)  # (B,) advantage of the next real token
    for t in reversed(range(T)):
        delta = r[:, t] + gamma * next_v - v[:, t]
        a = delta + gamma * lam * next_a
        adv[:, t] = torch.where(real[:, t], a, 0.0)
        next_v = torch.where(real[:, t], v[:, t], next_v)
        next_a = torch.where(real[:, t], a, next_a)
    returns = torch.where(real, adv + v, 0.0)
    if whiten:
        adv = _whiten_torch(adv, real)
    return adv, returns


def _whiten_torch(adv, real):
    """Masked whitening (mean, unbiased var over real tokens); 0 at masked positions."""
    n = real.sum()
    mean = torch.where(real, adv, 0.0).sum() / n.clamp_min(1)
    m2 = torch.where(real, (adv - mean) ** 2, 0.0).sum()
    var = m2 / (n - 1).clamp_min(1)
    return torch.where(real, (adv - mean) * torch.rsqrt(var + WHITEN_EPS), 0.0)


def _reverse_linear_scan(c, d):
    """x_t = d_t + c_t * x_{t+1}, x_T = 0, by log2(T) doubling steps. (B, T) -> (B, T)."""
    T, s = c.shape[1], 1
    while s < T:
        d = torch.cat([d[:, :-s] + c[:, :-s] * d[:, s:], d[:, -s:]], 1)
        c = torch.cat([c[:, :-s] * c[:, s:], c[:, -s:]], 1)
        s *= 2
    return d


def gae_torch(rewards, values, mask, gamma: float, lam: float, whiten: bool = False):
    """Vectorized PyTorch GAE (no loop over t): two doubling scans, same spec as gae_ref."""
    r, v, real = rewards.float(), values.float(), mask.bool()
    real_next = torch.cat([real[:, 1:], real.new_zeros(real.shape[0], 1)], 1)  # (B, T) m_{t+1}
    v_next = torch.cat([v[:, 1:], v.new_zeros(v.shape[0], 1)], 1)  # (B, T) v_{t+1}
    nv = _reverse_linear_scan((~real_next).float(), torch.where(real_next, v_next, 0.0))
    delta = r + gamma * nv - v
    c = torch.where(real, gamma * lam, 1.0)
    adv = _reverse_linear_scan(c, torch.where(real, delta, 0.0))
    adv = torch.where(real, adv, 0.0)
    returns = torch.where(real, adv + v, 0.0)
    if whiten:
        adv = _whiten_torch(adv, real)
    return adv, returns


@triton.jit
def _affine_combine(c1, d1, c2, d2):
    # apply x -> d1 + c1 x, then x -> d2 + c2 x (later time first)
    return c1 * c2, d2 + c2 * d1


@triton.jit
def _last_col(x, j, BLOCK_T: tl.constexpr):
    # (BLOCK_B, BLOCK_T) -> (BLOCK_B,): the column j == BLOCK_T - 1
    return tl.sum(tl.where(j == BLOCK_T - 1, x, 0.0), axis=1)


@triton.jit
def _gae_scan_kernel(r_ptr, v_ptr, m_ptr, adv_ptr, ret_ptr, stats_ptr, B, T, gamma, gamma_lam,
                     BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr, WHITEN: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_B + tl.arange(0, BLOCK_B)  # (BB,)
    base = rows.to(tl.int64)[:, None] * T  # (BB, 1)
    row_ok = (rows < B)[:, None]
    j = tl.arange(0, BLOCK_T)[None, :]  # (1, BT) reversed position in the chunk
    nv_carry = tl.zeros([BLOCK_B], dtype=tl.float32)
    a_carry = tl.zeros([BLOCK_B], dtype=tl.float32)
    n_chunks = tl.cdiv(T, BLOCK_T)
    for ci in range(n_chunks):
        t = T - 1 - ci * BLOCK_T - j  # (1, BT) descending time
        ok = row_ok & (t >= 0)
        nxt = row_ok & (t >= 0) & (t + 1 < T)
        r = tl.load(r_ptr + base + t, mask=ok, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + base + t, mask=ok, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + base + t, mask=ok, other=0) != 0
        v1 = tl.load(v_ptr + base + t + 1, mask=nxt, other=0.0).to(tl.float32)
        m1 = tl.load(m_ptr + base + t + 1, mask=nxt, other=0) != 0
        c, d = tl.associative_scan((tl.where(m1, 0.0, 1.0), tl.where(m1, v1, 0.0)), 1, _affine_combine)
        nv = d + c * nv_carry[:, None]  # (BB, BT) value of the next real token
        delta = r + gamma * nv - v
        c, d = tl.associative_scan((tl.where(m, gamma_lam, 1.0), tl.where(m, delta, 0.0)), 1, _affine_combine)
        a = d + c * a_carry[:, None]  # (BB, BT) advantage, carried over skipped tokens
        nv_carry = _last_col(nv, j, BLOCK_T)
        a_carry = _last_col(a, j, BLOCK_T)
        a = tl.where(m, a, 0.0)
        tl.store(adv_ptr + base + t, a, mask=ok)
        tl.store(ret_ptr + base + t, tl.where(m, a + v, 0.0), mask=ok)
        if WHITEN:  # per-tile (count, mean, M2) for the whitening pass
            n = tl.sum(m.to(tl.float32))
            mean = tl.sum(a) / tl.maximum(n, 1.0)
            m2 = tl.sum(tl.where(m, (a - mean) * (a - mean), 0.0))
            sp = stats_ptr + (pid * n_chunks + ci) * 3
            tl.store(sp, n)
            tl.store(sp + 1, mean)
            tl.store(sp + 2, m2)


@triton.jit
def _whiten_kernel(adv_ptr, m_ptr, stats_ptr, n_tiles, B, T, eps,
                   BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
    # global mean / unbiased var from the per-tile partials (Chan et al. merge)
    s = tl.arange(0, BLOCK_S)
    n_tot = 0.0
    sum_tot = 0.0
    for s0 in range(0, n_tiles, BLOCK_S):
        ok = s0 + s < n_tiles
        n = tl.load(stats_ptr + (s0 + s) * 3, mask=ok, other=0.0)
        n_tot += tl.sum(n)
        sum_tot += tl.sum(n * tl.load(stats_ptr + (s0 + s) * 3 + 1, mask=ok, other=0.0))
    mean = sum_tot / tl.maximum(n_tot, 1.0)
    m2_tot = 0.0
    for s0 in range(0, n_tiles, BLOCK_S):
        ok = s0 + s < n_tiles
        n = tl.load(stats_ptr + (s0 + s) * 3, mask=ok, other=0.0)
        dm = tl.load(stats_ptr + (s0 + s) * 3 + 1, mask=ok, other=0.0) - mean
        m2_tot += tl.sum(tl.load(stats_ptr + (s0 + s) * 3 + 2, mask=ok, other=0.0) + n * dm * dm)
    rstd = 1.0 / tl.sqrt(m2_tot / tl.maximum(n_tot - 1.0, 1.0) + eps)
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    base = rows.to(tl.int64)[:, None] * T  # (BB, 1)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)[None, :]
        ok = (rows < B)[:, None] & (t < T)
        a = tl.load(adv_ptr + base + t, mask=ok, other=0.0)
        m = tl.load(m_ptr + base + t, mask=ok, other=0) != 0
        tl.store(adv_ptr + base + t, tl.where(m, (a - mean) * rstd, 0.0), mask=ok)


def _tile(B: int, T: int):
    """(BLOCK_B, BLOCK_T) with BLOCK_B * BLOCK_T <= TILE, rows first along T."""
    block_t = min(next_pow2(T), TILE)
    return max(1, min(next_pow2(B), TILE // block_t)), block_t


def gae_triton(rewards, values, mask, gamma: float, lam: float, whiten: bool = False):
    """Triton GAE: one scan launch, plus one whitening launch when whiten=True."""
    B, T = values.shape
    r, v = rewards.contiguous(), values.contiguous()
    m = mask.contiguous()
    m = m.view(torch.uint8) if m.dtype == torch.bool else m
    adv = torch.empty(B, T, dtype=torch.float32, device=v.device)
    ret = torch.empty_like(adv)
    if B == 0 or T == 0:
        return adv, ret
    block_b, block_t = _tile(B, T)
    grid = (triton.cdiv(B, block_b),)
    n_tiles = grid[0] * triton.cdiv(T, block_t)
    stats = torch.empty(n_tiles * 3 if whiten else 1, dtype=torch.float32, device=v.device)
    _gae_scan_kernel[grid](r, v, m, adv, ret, stats, B, T, float(gamma), float(gamma * lam),
                           BLOCK_B=block_b, BLOCK_T=block_t, WHITEN=whiten, num_warps=NUM_WARPS)
    if whiten:
        _whiten_kernel[grid](adv, m, stats, n_tiles, B, T, WHITEN_EPS, BLOCK_B=block_b,
                             BLOCK_T=block_t, BLOCK_S=min(next_pow2(n_tiles), 1024), num_warps=NUM_WARPS)
    return adv, ret


def gae(rewards, values, mask, gamma: float, lam: float, whiten: bool = False, backend: str = "auto"):
    """GAE advantages and returns, see the module docstring for the exact spec.

    rewards, values: (B, T) float (any float dtype, fp32 accumulation); mask: (B, T)
    bool/int/float (nonzero = real token). Returns (advantages, returns), (B, T) fp32.
    """
    if values.dim() != 2 or rewards.shape != values.shape or mask.shape != values.shape:
        raise ValueError(f"gae wants (B, T) rewards/values/mask, got {tuple(rewards.shape)}, "
                         f"{tuple(values.shape)}, {tuple(mask.shape)}")
    impl = {"triton": gae_triton, "torch": gae_torch, "ref": gae_ref}[choose(backend, rewards, values, mask)]
    return impl(rewards, values, mask, gamma, lam, whiten)
