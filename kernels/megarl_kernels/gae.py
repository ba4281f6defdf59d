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

Kernel (`_gae_scan_kernel`). The state s_t = (A, W), the advantage and value of
the first real token at or after t, obeys s_t = f_t(s_{t+1}) with f_t affine:
    real t:   A <- (r_t - v_t) + gamma lam A + gamma W,   W <- v_t
    masked t: identity
Compositions keep the shape A <- p A + q W + a, W <- e W + w, so a span of
tokens is a 5-tuple (p, q, e, a, w), and the next real value needs no shifted
load: it is part of the state. One program owns BLOCK_B rows and walks T
backwards in BLOCK_T chunks; a chunk row is N groups of VEC consecutive tokens,
one group per thread, loaded in forward time order (16-byte vector loads):
  1. in registers, each group's map f_k o ... o f_{k+VEC-1} (a backward walk);
  2. one forward `tl.associative_scan` over the groups, ordered latest first,
     of (inclusive, exclusive) pairs: the exclusive part is the map of all
     later groups of the chunk, applied to the carry it gives the state after
     each group (`_excl_combine`);
  3. in registers, each group walked backwards from that state: A per token;
     stores in 16-byte pieces that already have the scan's register layout.
The state at the chunk's first token is the carry into the previous chunk;
the previous chunk's loads are issued before this chunk's work, so they fly
while it computes.

Why not a reverse scan over tokens: Triton 3.6 lowers
`tl.associative_scan(..., reverse=True)` with five butterfly shuffles per value
per direction (an all-lane flip), so a token-level reverse scan of the 5-tuple
on a 1 x 2048 tile with 4 warps compiles (sm_90) to 694 shuffles and 1544 SASS
instructions per thread, against 39 and 728 here. Combine order: a forward
scan calls combine(earlier, later) (`test_scan_combine_order`); here "earlier"
is later in time, so the result is map2 o map1.
"""
import torch

from megarl_kernels.dispatch import HAS_TRITON, choose, next_pow2, tl, triton

WHITEN_EPS = 1e-8

# Tiling. Any (B, T) is correct under any of these (the tests run tiles of 32..2048 on
# ragged shapes); they only set speed. Chosen by `benchmarks/bench_kernels.py --ops gae`'s sweep
# at B=512, T=2048 fp32, the shape of a large PPO batch (table in docs/performance.md). Shorter
# rows take several rows a program (`_tile`), longer ones several chunks, so other shapes keep
# one program's work near TILE elements.
# Longest chunk along T (power of 2); chunks carry the state backwards.
BLOCK_T = 512
# Elements per program (BLOCK_B * BLOCK_T); short rows get TILE // BLOCK_T rows each.
TILE = 512
# Warps per program.
NUM_WARPS = 2
# Most tokens per thread group (power of 2, <= 16): the in-register walk's length.
VEC_MAX = 16


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


# After _split_vec's LOG halvings part i holds position bitrev(i): 4-bit reversal >> (4 - LOG), LOG <= 4.
_BITREV16 = tl.constexpr((0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15)) if HAS_TRITON else None


@triton.jit
def _excl_combine(p1, q1, e1, a1, w1, P1, Q1, E1, A1, W1, p2, q2, e2, a2, w2, P2, Q2, E2, A2, W2):
    # (p, q, e, a, w) is the map (A, W) -> (p A + q W + a, e W + w) of a span of groups; (P..W) the
    # map of everything after the span's first group. Span 1 is later in time (scan order runs
    # backwards in time): inclusive = map2 o map1, exclusive = excl2 o map1.
    return (p2 * p1, p2 * q1 + q2 * e1, e2 * e1, a2 + p2 * a1 + q2 * w1, w2 + e2 * w1,
            P2 * p1, P2 * q1 + Q2 * e1, E2 * e1, A2 + P2 * a1 + Q2 * w1, W2 + E2 * w1)


@triton.jit
def _pick(x, idx, at, axis: tl.constexpr):
    # the slice idx == at of x along axis
    return tl.sum(tl.where(idx == at, x, 0.0), axis=axis)


@triton.jit
def _split_vec(x, LOG: tl.constexpr):
    # (..., 2**LOG), last dim in registers -> tuple of 2**LOG tensors (...), in time order
    parts = (tl.reshape(x, x.shape[:-1] + [2] * LOG),)
    for _ in tl.static_range(LOG):
        halves = ()
        for i in tl.static_range(len(parts)):
            even, odd = tl.split(parts[i])
            halves = halves + (even, odd)
        parts = halves
    ordered = ()
    for i in tl.static_range(len(parts)):
        ordered = ordered + (parts[_BITREV16[i] >> (4 - LOG)],)
    return ordered


@triton.jit
def _join_vec(parts, LOG: tl.constexpr):
    # inverse of _split_vec: tuple of 2**LOG tensors (...) -> (..., 2**LOG)
    ordered = ()
    for i in tl.static_range(len(parts)):
        ordered = ordered + (tl.expand_dims(parts[_BITREV16[i] >> (4 - LOG)], len(parts[0].shape)),)
    for _ in tl.static_range(LOG):
        pairs = ()
        for i in tl.static_range(len(ordered) // 2):
            pairs = pairs + (tl.join(ordered[2 * i], ordered[2 * i + 1]),)
        ordered = pairs
    return tl.reshape(ordered[0], parts[0].shape + [1 << LOG])


@triton.jit
def _load_groups(r_ptr, v_ptr, m_ptr, base, t, row_ok, T):
    # (BB, 1, 1) row offsets, (1, N, VEC) times -> r, v fp32 and the real-token mask, (BB, N, VEC)
    ok = row_ok & (t >= 0) & (t < T)
    r = tl.load(r_ptr + base + t, mask=ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + base + t, mask=ok, other=0.0).to(tl.float32)
    return r, v, tl.load(m_ptr + base + t, mask=ok, other=0) != 0


@triton.jit
def _group_maps(R, V, M, gamma, gamma_lam, VEC: tl.constexpr):
    # each group's map f_0 o ... o f_{VEC-1} (R, V, M: VEC parts (BB, N)) -> (p, q, e, a, w), (BB, N)
    p = tl.full(M[0].shape, 1.0, tl.float32)
    q = tl.zeros(M[0].shape, tl.float32)
    e = tl.full(M[0].shape, 1.0, tl.float32)
    a = tl.zeros(M[0].shape, tl.float32)
    w = tl.zeros(M[0].shape, tl.float32)
    for i in tl.static_range(VEC):  # f_k o (maps after k), k = VEC - 1 - i
        q = tl.where(M[VEC - 1 - i], gamma_lam * q + gamma * e, q)
        p = tl.where(M[VEC - 1 - i], gamma_lam * p, p)
        e = tl.where(M[VEC - 1 - i], 0.0, e)
        a = tl.where(M[VEC - 1 - i], R[VEC - 1 - i] - V[VEC - 1 - i] + gamma_lam * a + gamma * w, a)
        w = tl.where(M[VEC - 1 - i], V[VEC - 1 - i], w)
    return p, q, e, a, w


@triton.jit
def _group_advantages(R, V, M, A, W, gamma, gamma_lam, VEC: tl.constexpr):
    # walk each group backwards from the state (A, W) after it -> VEC parts of A (0 where masked)
    out = ()
    for i in tl.static_range(VEC):
        A = tl.where(M[VEC - 1 - i], R[VEC - 1 - i] - V[VEC - 1 - i] + gamma_lam * A + gamma * W, A)
        W = tl.where(M[VEC - 1 - i], V[VEC - 1 - i], W)
        out = (tl.where(M[VEC - 1 - i], A, 0.0),) + out
    return out


@triton.jit
def _store_groups(ptr, base, t_grp, row_ok, T, parts, VEC: tl.constexpr, SVEC: tl.constexpr,
                  LOG_SVEC: tl.constexpr):
    # VEC parts (BB, N) -> stores of SVEC-wide pieces at t_grp (1, N, 1) + offset, so each store
    # already has the scan's register layout (a full VEC-wide store would go through shared memory)
    k = tl.arange(0, SVEC)[None, None, :]
    for s in tl.static_range(VEC // SVEC):
        piece = ()
        for i in tl.static_range(SVEC):
            piece = piece + (parts[s * SVEC + i],)
        t = t_grp + s * SVEC + k
        tl.store(ptr + base + t, _join_vec(piece, LOG_SVEC), mask=row_ok & (t < T))


@triton.jit
def _group_stats(sp, stride, adv, M, VEC: tl.constexpr):
    # the tile's count, mean and M2 of its real tokens' advantages, stored at sp, sp + stride, sp + 2 stride;
    # over VEC parts (BB, N): summed in registers first, then one block reduction each
    n = M[0].to(tl.float32)
    s = adv[0]
    for i in tl.static_range(1, VEC):
        n += M[i].to(tl.float32)
        s += adv[i]
    n = tl.sum(n)
    mean = tl.sum(s) / tl.maximum(n, 1.0)
    m2 = tl.zeros(s.shape, tl.float32)
    for i in tl.static_range(VEC):
        m2 += tl.where(M[i], (adv[i] - mean) * (adv[i] - mean), 0.0)
    tl.store(sp, n)
    tl.store(sp + stride, mean)
    tl.store(sp + 2 * stride, tl.sum(m2))


@triton.jit
def _gae_scan_kernel(r_ptr, v_ptr, m_ptr, adv_ptr, ret_ptr, stats_ptr, B, T, gamma, gamma_lam,
                     BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr, LOG_VEC: tl.constexpr,
                     LOG_SVEC: tl.constexpr, WHITEN: tl.constexpr):
    VEC: tl.constexpr = 1 << LOG_VEC
    N: tl.constexpr = BLOCK_T // VEC  # groups per chunk row
    pid = tl.program_id(0)
    rows = pid * BLOCK_B + tl.arange(0, BLOCK_B)  # (BB,)
    base = rows.to(tl.int64)[:, None, None] * T  # (BB, 1, 1)
    row_ok = (rows < B)[:, None, None]
    g = tl.arange(0, N)[None, :]  # (1, N) group index, the chunk's last group first
    t_grp = (N - 1 - g[:, :, None]) * VEC  # (1, N, 1) group start within the chunk
    t_in = t_grp + tl.arange(0, VEC)[None, None, :]  # (1, N, VEC) forward in time within a group
    # A of the first real token after the chunk and its value, broadcast over groups (BB, N): kept
    # in the scan's layout (a (BB,) carry broadcast here went through shared memory, sm_90)
    a_carry = tl.zeros([BLOCK_B, N], dtype=tl.float32)
    w_carry = tl.zeros([BLOCK_B, N], dtype=tl.float32)
    n_chunks = tl.cdiv(T, BLOCK_T)
    r_nx, v_nx, m_nx = _load_groups(r_ptr, v_ptr, m_ptr, base, (n_chunks - 1) * BLOCK_T + t_in, row_ok, T)
    for ci in range(n_chunks):
        t0 = (n_chunks - 1 - ci) * BLOCK_T  # chunks from the end of the row
        r, v, m = r_nx, v_nx, m_nx  # loaded during the chunk before; the next chunk's loads go out now
        r_nx, v_nx, m_nx = _load_groups(r_ptr, v_ptr, m_ptr, base, t0 - BLOCK_T + t_in, row_ok, T)
        R = _split_vec(r, LOG_VEC)
        V = _split_vec(v, LOG_VEC)
        M = _split_vec(m, LOG_VEC)
        p, q, e, a, w = _group_maps(R, V, M, gamma, gamma_lam, VEC)
        one = tl.full(p.shape, 1.0, tl.float32)
        zero = tl.zeros(p.shape, tl.float32)
        p, q, e, a, w, xp, xq, xe, xa, xw = tl.associative_scan(
            (p, q, e, a, w, one, zero, one, zero, zero), 1, _excl_combine)
        A = xa + xp * a_carry + xq * w_carry  # (BB, N) state after each group
        W = xw + xe * w_carry
        if ci + 1 < n_chunks:  # state at the chunk's first token: the carry into the previous chunk
            a_first = _pick(a + p * a_carry + q * w_carry, g, N - 1, 1)[:, None]
            w_carry = tl.broadcast_to(_pick(w + e * w_carry, g, N - 1, 1)[:, None], (BLOCK_B, N))
            a_carry = tl.broadcast_to(a_first, (BLOCK_B, N))
        adv = _group_advantages(R, V, M, A, W, gamma, gamma_lam, VEC)
        ret = ()
        for i in tl.static_range(VEC):
            ret = ret + (tl.where(M[i], adv[i] + V[i], 0.0),)
        _store_groups(adv_ptr, base, t0 + t_grp, row_ok, T, adv, VEC, 1 << LOG_SVEC, LOG_SVEC)
        _store_groups(ret_ptr, base, t0 + t_grp, row_ok, T, ret, VEC, 1 << LOG_SVEC, LOG_SVEC)
        if WHITEN:
            _group_stats(stats_ptr + pid * n_chunks + ci, tl.num_programs(0) * n_chunks, adv, M, VEC)


@triton.jit
def _merged_moments(stats_ptr, n_tiles, eps, BLOCK_S: tl.constexpr):
    # global mean and 1 / std from the per-tile partials (Chan et al. merge); stats_ptr holds
    # (3, n_tiles): counts, means, M2s
    s = tl.arange(0, BLOCK_S)
    n_tot = 0.0
    sum_tot = 0.0
    for s0 in range(0, n_tiles, BLOCK_S):
        ok = s0 + s < n_tiles
        n = tl.load(stats_ptr + s0 + s, mask=ok, other=0.0)
        n_tot += tl.sum(n)
        sum_tot += tl.sum(n * tl.load(stats_ptr + n_tiles + s0 + s, mask=ok, other=0.0))
    mean = sum_tot / tl.maximum(n_tot, 1.0)
    m2_tot = 0.0
    for s0 in range(0, n_tiles, BLOCK_S):
        ok = s0 + s < n_tiles
        n = tl.load(stats_ptr + s0 + s, mask=ok, other=0.0)
        dm = tl.load(stats_ptr + n_tiles + s0 + s, mask=ok, other=0.0) - mean
        m2_tot += tl.sum(tl.load(stats_ptr + 2 * n_tiles + s0 + s, mask=ok, other=0.0) + n * dm * dm)
    return mean, 1.0 / tl.sqrt(m2_tot / tl.maximum(n_tot - 1.0, 1.0) + eps)


@triton.jit
def _load_adv(adv_ptr, m_ptr, base, t, row_ok, T):
    ok = row_ok & (t < T)
    return tl.load(adv_ptr + base + t, mask=ok, other=0.0), tl.load(m_ptr + base + t, mask=ok, other=0) != 0


@triton.jit
def _whiten_kernel(adv_ptr, m_ptr, stats_ptr, n_tiles, B, T, eps,
                   BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    base = rows.to(tl.int64)[:, None] * T  # (BB, 1)
    row_ok = (rows < B)[:, None]
    j = tl.arange(0, BLOCK_T)[None, :]
    a, m = _load_adv(adv_ptr, m_ptr, base, j, row_ok, T)  # issued first: the merge hides its latency
    mean, rstd = _merged_moments(stats_ptr, n_tiles, eps, BLOCK_S)
    for t0 in range(0, T, BLOCK_T):
        a_nx, m_nx = _load_adv(adv_ptr, m_ptr, base, t0 + BLOCK_T + j, row_ok, T)
        tl.store(adv_ptr + base + t0 + j, tl.where(m, (a - mean) * rstd, 0.0), mask=row_ok & (t0 + j < T))
        a, m = a_nx, m_nx


def _tile(B: int, T: int):
    """(block_b, block_t): block_t <= min(BLOCK_T, TILE), block_b * block_t <= TILE, T first."""
    block_t = min(next_pow2(T), BLOCK_T, TILE)
    return max(1, min(next_pow2(B), TILE // block_t)), block_t


def _log_vec(block_b: int, block_t: int) -> int:
    """log2 of the tokens per thread group: the tile spread over all threads, at most VEC_MAX (<= 16)."""
    per_thread = max(1, block_b * block_t // (32 * NUM_WARPS))
    return (min(per_thread, VEC_MAX, block_t, 16)).bit_length() - 1


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
    args = (r, v, m, adv, ret, stats, B, T, float(gamma), float(gamma * lam))
    tiles = dict(BLOCK_B=block_b, BLOCK_T=block_t, WHITEN=whiten, num_warps=NUM_WARPS)
    log_vec = _log_vec(block_b, block_t)
    _gae_scan_kernel[grid](*args, LOG_VEC=log_vec, LOG_SVEC=min(log_vec, 2), **tiles)
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
