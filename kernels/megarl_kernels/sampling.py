"""Next-token sampling in one graph-capturable op: temperature, top-k, top-p, per-request noise.

Spec (`sample_tokens_ref`). logits (B, V); only columns [0, n) are the real
vocab (n = vocab_size, default V; padding columns past n are never candidates
and are in no softmax). Per row, with T = temperature (T <= 0: greedy, then T = 1):
    s_j = l_j / T                                     scaled logits, j < n
    logprob = log_softmax(s)[token]                   over the whole real vocab, unfiltered
    greedy:  token = argmax_j s_j                     lowest index on ties
    top-k (0 < k < n): keep j with s_j >= the k-th largest s (boundary ties all kept)
    top-p (p < 1): on the kept set renormalized, sort probs descending, take the
        shortest prefix with cumulative mass >= p; keep every j whose prob is
        >= the prob of that prefix's last element (ties kept)
    sample:  token = argmax over kept j of  s_j - log E_j,  E_j = -log1p(-u_j)
The last line is the exponential race (Gumbel-max with g = -log E): E_j ~ Exp(1)
independent, so P(token = j) = exp(s_j) / sum_kept exp(s) exactly.

Noise. u_j = u(seed, offset, j), from the request's seed, the token's index in the
request and the vocab id alone (`sampling_noise.py`): never from batch composition or row position.

Kernels (no host sync, outputs sized from shapes: CUDA-graph capturable).
  1. `_partials_kernel`, grid (B, S), S from the vocab size only (so nothing
     depends on the batch): each program streams one slice of a row in BLOCK
     chunks once: running max m, sum exp(s - m), and for unfiltered sampled
     rows the race itself (max of s - log E), for the others argmax and min key.
  2. `_finish_kernel`, grid (B,): merges the S partials. Rows with top-k / top-p
     find their threshold by bisection on order-preserving int32 keys of s,
     no sort: each step counts (or sums exp(s - m) over) the elements with key
     >= mid, snapping lo up / hi down to the nearest element keys and stopping
     as soon as removing the smallest kept value breaks the condition (<= 33
     steps, capped at 40; emulated on V=151936 rows: 11-18 for top_k=50, 7-21
     for top_p=0.9). top-p is the largest threshold whose kept mass is
     >= p * (top-k mass): the ref's set up to fp rounding. Then one race pass
     over the kept set. Rows choose at run time (scalar branches), so one
     launch serves greedy, plain and filtered rows together.
  On the GPU the race's two logs are the hardware's approximate log2 (`_log`,
  relative error ~2^-22; the ref's logs are correctly rounded): a race value
  moves by ~1e-6 at most, so the kernel's token differs from the ref's only
  where the two best race values of a row are that close (never seen at full
  size: tests/test_kernel_sampling.py).
The torch backend vectorizes the same steps (topk, and a histogram for flat
top-p rows, for the thresholds; the int32 hash) and gives the ref's tokens.
Plain and greedy rows cost one pass over the logits; filtered rows are single-program
bisections, several times slower (`benchmarks/bench_sampling.py`; numbers in
benchmarks/RESULTS.md and docs/performance.md).
"""
import torch

from megarl_kernels.dispatch import choose, interpret_mode, libdevice, next_pow2, tl, triton
from megarl_kernels.sampling_noise import noise_i32, row_keys, row_keys_ref, to_i32, uniform, uniform_noise_ref, weyl_i32

# Vocab chunk per loop step and warps per program of the first launch (`_partials_kernel`), and its
# chunks per program: a row is split into cdiv(n, SPLIT_CHUNKS * BLOCK_V) slices, from the vocab size
# alone, so a row's partials (and the order they merge in) never depend on the batch: tokens and
# logprobs are bit-identical alone or in any batch. Chosen by `bench_sampling.py --sweep` (bf16,
# V = 151,936, B = 32 / 128 / 512; table in docs/performance.md): short chunks on 4 warps keep
# more programs resident in this latency-bound pass. Any vocab size is correct; another V only
# changes the slice count.
BLOCK_V = 2048
NUM_WARPS = 4
SPLIT_CHUNKS = 4
# The second launch (`_finish_kernel`): one program per row; filtered rows bisect over the whole row
# there, so it wants wide chunks (same sweep, top_p = 0.9).
FINISH_BLOCK_V = 8192
FINISH_WARPS = 16
# torch backend: rows per chunk so an (R, n) fp32 temporary is <= 2^22 elements (16 MiB); the
# hash runs on row blocks of <= 2^20 elements (4 MiB int32): the fastest block size on a 2-core CPU
# (docs/performance.md).
TORCH_CHUNK_ELEMS = 1 << 22
TORCH_HASH_ELEMS = 1 << 20
# torch top-p: the prefix is looked for in the TOP_P_CANDIDATES largest values (topk); longer
# prefixes (flat rows) use an e-weighted histogram of TOP_P_BINS bins and sort one bin.
# On flat rows the histogram takes under half the time of sorting the whole row (docs/performance.md).
# Bins not tuned.
TOP_P_CANDIDATES = 1024
TOP_P_BINS = 2048


# ---- the spec ----

def _keep_ref(s, k: int, p: float):
    """(n,) scaled logits -> (n,) bool kept set under top-k then top-p."""
    n = s.numel()
    keep = torch.ones(n, dtype=torch.bool, device=s.device)
    if 0 < k < n:
        keep = s >= torch.sort(s, descending=True).values[k - 1]
    if p < 1:
        probs = torch.softmax(torch.where(keep, s, float("-inf")), -1)  # renormalized over the kept set
        sp = torch.sort(probs[keep], descending=True).values
        last = min(int((torch.cumsum(sp, 0) < p).sum()), sp.numel() - 1)  # shortest prefix with mass >= p
        keep &= probs >= sp[last]
    return keep


def sample_tokens_ref(logits, temperature, top_k, top_p, seeds, offsets, vocab_size=None):
    """The spec: a Python loop over rows with sorts. Returns tokens (B,) int64, logprobs (B,) fp32."""
    n = logits.shape[1] if vocab_size is None else vocab_size
    u = uniform_noise_ref(seeds, offsets, n)  # (B, n)
    tokens, logprobs = [], []
    for b in range(logits.shape[0]):
        t = temperature[b].float()
        greedy = bool(t <= 0)
        s = logits[b, :n].float() / (1.0 if greedy else t)  # (n,)
        if greedy:
            tok = int(torch.argmax(s))
        else:
            race = s - torch.log(-torch.log1p(-u[b]))
            keep = _keep_ref(s, int(top_k[b]), float(top_p[b]))
            tok = int(torch.argmax(torch.where(keep, race, float("-inf"))))
        tokens.append(tok)
        logprobs.append(torch.log_softmax(s, -1)[tok])
    dev = logits.device
    return (torch.tensor(tokens, dtype=torch.int64, device=dev),
            torch.stack(logprobs).float() if logprobs else torch.empty(0, device=dev))


# ---- torch backend: vectorized over rows, chunked ----

def _inv_temperature(temperature):
    """(B,) -> (inv_t (B,) fp32 with 1 for greedy rows, greedy (B,) bool)."""
    t = temperature.float()
    greedy = t <= 0
    return torch.where(greedy, 1.0, 1.0 / torch.where(greedy, 1.0, t)), greedy


def _top_p_hist(s, e, target):
    """One row whose prefix is long (flat rows): (n,) s, kept mass e, target -> threshold on s.

    An e-weighted histogram of s over TOP_P_BINS finds the bin where the mass from the top
    crosses target; only that bin is sorted. O(n) plus a small sort instead of sorting the row.
    """
    live = e > 0
    lo, hi = torch.where(live, s, float("inf")).amin(), s.amax()
    b = (s - lo).mul_(TOP_P_BINS / (hi - lo).clamp_min(1e-30)).clamp_(0, TOP_P_BINS - 1).long()  # (n,)
    hist = torch.zeros(TOP_P_BINS, dtype=e.dtype, device=e.device).scatter_add_(0, b, e)
    above = hist.flip(0).cumsum(0).flip(0)  # mass of the bins >= i, non-increasing
    i = max(int((above >= target).sum()) - 1, 0)  # the bin holding the prefix's last element
    cand = live & (b == i)
    sv, order = torch.sort(s[cand], descending=True)
    cums = e[cand][order].cumsum(0) + (above[i + 1] if i + 1 < TOP_P_BINS else 0.0)
    return sv[min(int((cums < target).sum()), sv.numel() - 1)]


def _top_p_torch(s, thr_k, p):
    """(r, n) scaled logits, top-k thresholds (r,), top_p (r,) -> top-p thresholds on s (r,).

    The prefix is looked for among the TOP_P_CANDIDATES largest values; rows whose prefix
    is longer go through `_top_p_hist`.
    """
    m = s.amax(-1, keepdim=True)
    kept = s >= thr_k[:, None]
    e = torch.where(kept, torch.exp(s - m), 0.0)  # (r, n) kept mass, in units of exp(m)
    n_kept, target = kept.sum(-1), p * e.sum(-1)
    K = min(s.shape[1], TOP_P_CANDIDATES)
    sv = torch.topk(s, K, -1).values  # (r, K) descending
    cums = torch.where(sv >= thr_k[:, None], torch.exp(sv - m), 0.0).cumsum(-1)
    last = (cums < target[:, None]).sum(-1)  # index of the shortest prefix's last element
    thr = sv.gather(-1, torch.minimum(last, n_kept - 1).clamp_max(K - 1)[:, None])[:, 0]
    for i in ((last >= K) & (n_kept > K)).nonzero()[:, 0].tolist():
        thr[i] = _top_p_hist(s[i], e[i], target[i])
    return thr


def _thresholds_torch(s, k, p):
    """(r, n), top_k (r,), top_p (r,) -> thresholds (r,) on s: keep s >= thr (-inf keeps all)."""
    n = s.shape[1]
    thr = torch.full((s.shape[0],), float("-inf"), device=s.device)
    k_on, p_on = (k > 0) & (k < n), p < 1
    if bool(k_on.any()):
        kmax = int(k[k_on].max())
        kth = torch.topk(s, kmax, -1).values.gather(-1, (k.clamp(1, kmax) - 1).long()[:, None])[:, 0]
        thr = torch.where(k_on, kth, thr)
    if bool(p_on.any()):
        rows = p_on.nonzero()[:, 0]
        thr[rows] = _top_p_torch(s[rows], thr[rows], p[rows])
    return thr


def _race_torch(s, thr, k1, k2, jg):
    """argmax over s >= thr of s - log E: (r, n), (r,), keys (r,) int32, jg (n,) -> (r,) int64."""
    tok = torch.empty(s.shape[0], dtype=torch.int64, device=s.device)
    step = max(1, TORCH_HASH_ELEMS // s.shape[1])
    for i in range(0, s.shape[0], step):
        sl = slice(i, i + step)
        neg_log_e = noise_i32(k1[sl], k2[sl], jg).neg_().log1p_().neg_().log_().neg_()  # (r, n)
        race = neg_log_e.add_(s[sl]).masked_fill_(s[sl] < thr[sl, None], float("-inf"))
        tok[sl] = race.argmax(-1)
    return tok


def sample_tokens_torch(logits, temperature, top_k, top_p, seeds, offsets, vocab_size=None):
    """Vectorized PyTorch (CPU path): host syncs allowed; same tokens as the ref."""
    B, n = logits.shape[0], logits.shape[1] if vocab_size is None else vocab_size
    dev = logits.device
    tokens = torch.empty(B, dtype=torch.int64, device=dev)
    logprobs = torch.empty(B, dtype=torch.float32, device=dev)
    inv_t, greedy = _inv_temperature(temperature)
    k1, k2 = (to_i32(k) for k in row_keys_ref(seeds, offsets))
    jg = weyl_i32(n, dev)
    step = max(1, TORCH_CHUNK_ELEMS // max(n, 1))
    for i in range(0, B, step):
        sl = slice(i, min(i + step, B))
        s = logits[sl, :n].float() * inv_t[sl, None]  # (R, n)
        tok = s.argmax(-1)
        rows = (~greedy[sl]).nonzero()[:, 0]
        if rows.numel():
            thr = _thresholds_torch(s[rows], top_k[sl][rows], top_p[sl][rows].float())
            tok[rows] = _race_torch(s[rows], thr, k1[sl][rows], k2[sl][rows], jg)
        tokens[sl] = tok
        logprobs[sl] = s.gather(-1, tok[:, None])[:, 0] - torch.logsumexp(s, -1)
    return tokens, logprobs


# ---- Triton backend ----

@triton.jit
def _key(s):
    """fp32 -> int32 with the same order (-0.0 and +0.0 get one key)."""
    b = tl.where(s == 0.0, 0.0, s).to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def _unkey(k):
    return tl.where(k >= 0, k, k ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _log(x, FAST_LOG: tl.constexpr):
    """Natural log of fp32 x > 0: on the GPU the hardware's approximate log2 (one MUFU.LG2, relative
    error ~2^-22) times ln 2 (`FAST_LOG`); tl.log otherwise (the interpreter has no fast log)."""
    if FAST_LOG:
        return libdevice.fast_logf(x)
    return tl.log(x)


@triton.jit
def _race_chunk(s, keep, j, k1, k2, FAST_LOG: tl.constexpr):
    """Chunk max of s - log E over keep and its lowest index (2^31 - 1 if none)."""
    u = uniform(k1, k2, j)  # E = -log1p(-u): a 4-term series below 1/32 (rel. error < u^4/5 <= 2e-7)
    e = tl.where(u < 0.03125, u * (1.0 + u * (0.5 + u * (0.3333333333333333 + u * 0.25))), -_log(1.0 - u, FAST_LOG))
    r = tl.where(keep, s - _log(e, FAST_LOG), float("-inf"))
    cm = tl.max(r, 0)
    return cm, tl.min(tl.where(keep & (r == cm), j, 2147483647), 0)


@triton.jit
def _row_setup(row, temp_ptr, topk_ptr, topp_ptr, seed_ptr, off_ptr, n):
    t = tl.load(temp_ptr + row)
    greedy = t <= 0.0
    inv_t = tl.math.div_rn(1.0, tl.where(greedy, 1.0, t))  # the torch backend's 1 / T, bit for bit
    k = tl.load(topk_ptr + row)
    p = tl.load(topp_ptr + row)
    filtered = ((k > 0) & (k < n)) | (p < 1.0)
    k1, k2 = row_keys(tl.load(seed_ptr + row), tl.load(off_ptr + row))
    return inv_t, greedy, filtered, k, p, k1, k2


@triton.jit
def _partials_kernel(x_ptr, stride, n, temp_ptr, topk_ptr, topp_ptr, seed_ptr, off_ptr, pf_ptr, pi_ptr,
                     B, S, split_len, BLOCK: tl.constexpr, FAST_LOG: tl.constexpr):
    row, sp = tl.program_id(0), tl.program_id(1)
    xr = x_ptr + row.to(tl.int64) * stride
    inv_t, greedy, filtered, k, p, k1, k2 = _row_setup(row, temp_ptr, topk_ptr, topp_ptr, seed_ptr, off_ptr, n)
    race = (~greedy) & (~filtered)
    start = sp * split_len
    end = tl.minimum(start + split_len, n)
    cols = tl.arange(0, BLOCK)
    m = -1e30  # finite: exp(m - m_new) stays 0, never nan, on the first chunk
    z = 0.0
    am = start
    mn = 2147483647
    rb = float("-inf")
    ri = 2147483647
    for v0 in range(start, end, BLOCK):
        j = v0 + cols  # (BLOCK,)
        ok = j < end
        s = tl.load(xr + j, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
        cmax = tl.max(s, 0)
        m_new = tl.maximum(m, cmax)
        z = z * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new), 0)
        if race:  # plain sampled rows: the race is the token
            cm, cj = _race_chunk(s, ok, j, k1, k2, FAST_LOG)
            ri = tl.where(cm > rb, cj, ri)
            rb = tl.maximum(rb, cm)
        else:  # greedy rows: the argmax; filtered rows: the min key starts their bisections
            am = tl.where(cmax > m, tl.min(tl.where(ok & (s == cmax), j, 2147483647), 0), am)
            mn = tl.minimum(mn, tl.min(tl.where(ok, _key(s), 2147483647), 0))
        m = m_new
    o = row * S + sp  # partials (3, B, S) fp32: m, z, race max; (3, B, S) int32: argmax, race argmax, min key
    tl.store(pf_ptr + o, m)
    tl.store(pf_ptr + B * S + o, z)
    tl.store(pf_ptr + 2 * B * S + o, rb)
    tl.store(pi_ptr + o, am)
    tl.store(pi_ptr + B * S + o, ri)
    tl.store(pi_ptr + 2 * B * S + o, mn)


@triton.jit
def _count_above(xr, n, inv_t, m, c, BLOCK: tl.constexpr):
    """Over keys >= c: count, sum exp(s - m), min key and its count; and the max key < c."""
    cols = tl.arange(0, BLOCK)
    cnt = 0
    mass = 0.0
    amin = 2147483647
    acnt = 0
    bmax = -2147483648
    for v0 in range(0, n, BLOCK):
        j = v0 + cols
        ok = j < n
        s = tl.load(xr + j, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
        key = _key(s)
        above = ok & (key >= c)
        cnt += tl.sum(above.to(tl.int32), 0)
        mass += tl.sum(tl.where(above, tl.exp(s - m), 0.0), 0)
        cmin = tl.min(tl.where(above, key, 2147483647), 0)
        ccnt = tl.sum((above & (key == cmin)).to(tl.int32), 0)
        acnt = tl.where(cmin < amin, ccnt, tl.where(cmin == amin, acnt + ccnt, acnt))
        amin = tl.minimum(amin, cmin)
        bmax = tl.maximum(bmax, tl.max(tl.where(ok & (key < c), key, -2147483648), 0))
    return cnt, mass, amin, acnt, bmax


@triton.jit
def _bisect(xr, n, inv_t, m, lo, hi, lo_mass, k, target, BY_MASS: tl.constexpr, BLOCK: tl.constexpr):
    """Largest element key c in [lo, hi) whose set {key >= c} has count >= k (or mass >= target).

    Invariants: {key >= lo} passes the test, {key >= hi} fails it; each step moves lo up to the
    smallest element key >= mid or hi down to the largest element key < mid, plus one, so the
    bracket at least halves (clamped to mid: termination never rests on the snapping) and at
    most 33 steps run. Returns (c, mass of {key >= c}).
    """
    steps = 0
    while (hi - lo > 1) & (steps < 40):
        mid = lo + (hi - lo) // 2
        cnt, mass, amin, acnt, bmax = _count_above(xr, n, inv_t, m, mid.to(tl.int32), BLOCK)
        if BY_MASS:
            ok = mass >= target
            still_ok = mass - acnt.to(tl.float32) * tl.exp(_unkey(amin) - m) >= target  # {key > amin}
        else:
            ok = cnt >= k
            still_ok = cnt - acnt >= k
        up = tl.maximum(amin.to(tl.int64), mid)
        hi = tl.where(ok, tl.where(still_ok, hi, up + 1), tl.minimum(bmax.to(tl.int64) + 1, mid))
        lo_mass = tl.where(ok, mass, lo_mass)
        lo = tl.where(ok, up, lo)
        steps += 1
    return lo, lo_mass


@triton.jit
def _filtered_race(xr, n, inv_t, m, z, mn, k, p, k1, k2, BLOCK: tl.constexpr, FAST_LOG: tl.constexpr):
    """Top-k then top-p thresholds by bisection, then the race over the kept set."""
    top = _key(m).to(tl.int64) + 1
    lo = mn.to(tl.int64)
    k_on = (k > 0) & (k < n)
    lo, zk = _bisect(xr, n, inv_t, m, lo, tl.where(k_on, top, lo + 1), z, k, 0.0, False, BLOCK)
    target = tl.maximum(p * zk, 1e-30)  # p <= 0 keeps the top value (its mass is 1)
    c, _ = _bisect(xr, n, inv_t, m, lo, tl.where(p < 1.0, top, lo + 1), zk, k, target, True, BLOCK)
    cols = tl.arange(0, BLOCK)
    rb = float("-inf")
    ri = 2147483647
    for v0 in range(0, n, BLOCK):
        j = v0 + cols
        ok = j < n
        s = tl.load(xr + j, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
        cm, cj = _race_chunk(s, ok & (_key(s) >= c.to(tl.int32)), j, k1, k2, FAST_LOG)
        ri = tl.where(cm > rb, cj, ri)
        rb = tl.maximum(rb, cm)
    return rb, ri


@triton.jit
def _finish_kernel(x_ptr, stride, n, temp_ptr, topk_ptr, topp_ptr, seed_ptr, off_ptr, pf_ptr, pi_ptr,
                   tok_ptr, lp_ptr, B, S, S_BLOCK: tl.constexpr, BLOCK: tl.constexpr, FAST_LOG: tl.constexpr):
    row = tl.program_id(0)
    xr = x_ptr + row.to(tl.int64) * stride
    inv_t, greedy, filtered, k, p, k1, k2 = _row_setup(row, temp_ptr, topk_ptr, topp_ptr, seed_ptr, off_ptr, n)
    i = tl.arange(0, S_BLOCK)
    o = row * S + i  # (S_BLOCK,)
    ok = i < S
    mi = tl.load(pf_ptr + o, mask=ok, other=float("-inf"))
    m = tl.max(mi, 0)
    z = tl.sum(tl.load(pf_ptr + B * S + o, mask=ok, other=0.0) * tl.exp(mi - m), 0)
    am = tl.min(tl.where(ok & (mi == m), tl.load(pi_ptr + o, mask=ok, other=0), 2147483647), 0)
    rbi = tl.load(pf_ptr + 2 * B * S + o, mask=ok, other=float("-inf"))
    rb = tl.max(rbi, 0)
    ri = tl.min(tl.where(ok & (rbi == rb), tl.load(pi_ptr + B * S + o, mask=ok, other=0), 2147483647), 0)
    mn = tl.min(tl.load(pi_ptr + 2 * B * S + o, mask=ok, other=2147483647), 0)
    if filtered & (~greedy):
        rb, ri = _filtered_race(xr, n, inv_t, m, z, mn, k, p, k1, k2, BLOCK, FAST_LOG)
    tok = tl.where(greedy | (rb == float("-inf")), am, ri)
    s_tok = tl.load(xr + tok).to(tl.float32) * inv_t
    tl.store(tok_ptr + row, tok.to(tl.int64))
    tl.store(lp_ptr + row, s_tok - m - tl.log(z))


def _split_len(n: int, block: int, splits=None) -> int:
    """Columns per first-launch program, a multiple of block; from n alone (batch invariance)."""
    chunks = triton.cdiv(n, block)
    return block * (triton.cdiv(chunks, min(chunks, splits)) if splits else min(chunks, SPLIT_CHUNKS))


def sample_tokens_triton(logits, temperature, top_k, top_p, seeds, offsets, vocab_size=None,
                         block=None, splits=None, out=None):
    """Triton: two launches, no host sync. block / splits override both launches' chunk and the row split (tests);
    out as in `sample_tokens` (the second launch stores there: no copies after it)."""
    B, n = logits.shape[0], logits.shape[1] if vocab_size is None else vocab_size
    dev = logits.device
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    if out is not None:
        tokens, logprobs = out[0], out[1]
    else:
        tokens = torch.empty(B, dtype=torch.int64, device=dev)
        logprobs = torch.empty(B, dtype=torch.float32, device=dev)
    if B == 0:
        return tokens, logprobs
    blk = block or min(BLOCK_V, next_pow2(n))
    finish_blk = block or min(FINISH_BLOCK_V, next_pow2(n))
    split_len = _split_len(n, blk, splits)
    S = triton.cdiv(n, split_len)
    pf = torch.empty(3, B, S, dtype=torch.float32, device=dev)
    pi = torch.empty(3, B, S, dtype=torch.int32, device=dev)
    rows = (temperature.float().contiguous(), top_k.to(torch.int32).contiguous(), top_p.float().contiguous(),
            seeds.long().contiguous(), offsets.long().contiguous())
    fast_log = not interpret_mode()
    _partials_kernel[(B, S)](x, x.stride(0), n, *rows, pf, pi, B, S, split_len, BLOCK=blk, FAST_LOG=fast_log,
                             num_warps=NUM_WARPS)
    _finish_kernel[(B,)](x, x.stride(0), n, *rows, pf, pi, tokens, logprobs, B, S,
                         S_BLOCK=next_pow2(S), BLOCK=finish_blk, FAST_LOG=fast_log, num_warps=FINISH_WARPS)
    return tokens, logprobs


def sample_tokens(logits, temperature, top_k, top_p, seeds, offsets, vocab_size=None, backend: str = "auto",
                  out=None):
    """Sample one next token per row; spec in the module docstring.

    logits: (B, V) fp32 / bf16 / fp16, unit stride along V; columns >= vocab_size are padding.
    temperature (B,) fp32 (<= 0: greedy); top_k (B,) int (<= 0 or >= vocab_size: off);
    top_p (B,) fp32 in (0, 1] (1: off); seeds (B,) int64 (any value); offsets (B,) int64
    (index of the sampled token within its request). Returns tokens (B,) int64 and
    logprobs (B,) fp32 = log_softmax(logits / T)[token] over the real vocab, unfiltered.
    out: a (2, B) fp32 tensor with unit-stride rows to write [tokens; logprobs] into instead (the
    token ids as fp32, exact below 2^24); then (out[0], out[1]) is returned.
    """
    B, V = logits.shape if logits.dim() == 2 else (None, None)
    n = V if vocab_size is None else int(vocab_size)
    if B is None or any(t.shape != (B,) for t in (temperature, top_k, top_p, seeds, offsets)):
        raise ValueError("sample_tokens wants logits (B, V) and temperature, top_k, top_p, seeds, offsets (B,); "
                         f"got {tuple(logits.shape)}, " + ", ".join(str(tuple(t.shape)) for t in
                                                                   (temperature, top_k, top_p, seeds, offsets)))
    if not 0 < n <= V or n >= 2**31:
        raise ValueError(f"vocab_size={vocab_size} must be in [1, V={V}] and < 2^31")
    if out is not None and (out.shape != (2, B) or out.dtype != torch.float32 or out.stride(1) != 1):
        raise ValueError(f"sample_tokens: out must be (2, B) = (2, {B}) fp32 with unit-stride rows, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    impl = {"triton": sample_tokens_triton, "torch": sample_tokens_torch,
            "ref": sample_tokens_ref}[choose(backend, logits, temperature, top_k, top_p, seeds, offsets)]
    if impl is sample_tokens_triton:
        return impl(logits, temperature, top_k, top_p, seeds, offsets, n, out=out)
    tokens, logprobs = impl(logits, temperature, top_k, top_p, seeds, offsets, n)
    if out is None:
        return tokens, logprobs
    out[0].copy_(tokens)
    out[1].copy_(logprobs)
    return out[0], out[1]
