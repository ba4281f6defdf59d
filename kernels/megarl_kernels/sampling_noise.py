"""Per-request sampling noise for `sampling.py`'s exponential race: a counter-based hash to u in (0, 1).

Spec (`uniform_noise_ref`). u_j = u(seed, offset, j) depends only on the request's seed, the index
`offset` of the token being sampled within the request, and the vocab id j:
never on batch composition or row position. All arithmetic is mod 2^32, with
fmix32 the murmur3 finalizer (h ^= h >> 16; h *= 0x85EBCA6B; h ^= h >> 13;
h *= 0xC2B2AE35; h ^= h >> 16) and absorb(h, w) = fmix32(((h ^ w) + 0x9E3779B9)):
    k1 = absorb(absorb(absorb(absorb(0x6A09E667, seed_lo), seed_hi), off_lo), off_hi)
    k2 = absorb(k1, 0x243F6A88)                      (seed_lo/hi: the two 32-bit words of the int64)
    h  = fmix32(fmix32(k1 + j * 0x9E3779B9) ^ k2)
    u  = min(((h >> 1) + 0.5) * 2^-31, 1 - 2^-24)    fp32 ops: int -> fp32 (round to nearest), +0.5, scale
u is in (0, 1), never 0 or 1. Its resolution near 0 is ~2^-31 (relative 2^-24)
because winners of the race have small E ~= u: a 24-bit u would tie the
winners of a flat 150k-token row in ~2% of draws. The torch code computes it on
int64 (spec) or int32 (fast) tensors, the kernels on uint32, bit-identically
(`uniform_noise`). Rows whose (seed, offset) collide in k1 (2^-32 per pair) share noise.
"""
import torch

from megarl_kernels.dispatch import choose, next_pow2, tl, triton

M32 = 0xFFFFFFFF
GOLD, FMIX_C1, FMIX_C2 = 0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35
ROW_INIT, K2_SALT = 0x6A09E667, 0x243F6A88
U_MAX = 1.0 - 2.0 ** -24  # largest fp32 below 1


# ---- the hash: spec on int64 tensors (mask to 32 bits after every multiply / add) ----

def _fmix32_ref(h):
    h = h ^ (h >> 16)
    h = (h * FMIX_C1) & M32  # may overflow int64: torch wraps, the low 32 bits are right
    h = h ^ (h >> 13)
    h = (h * FMIX_C2) & M32
    return h ^ (h >> 16)


def _absorb_ref(h, w):
    return _fmix32_ref(((h ^ w) + GOLD) & M32)


def row_keys_ref(seeds, offsets):
    """(B,) int64 seeds, offsets -> (k1, k2), each (B,) int64 in [0, 2^32)."""
    seeds, offsets = seeds.long(), offsets.long()
    h = torch.full_like(seeds, ROW_INIT)
    for w in (seeds & M32, (seeds >> 32) & M32, offsets & M32, (offsets >> 32) & M32):
        h = _absorb_ref(h, w)
    return h, _absorb_ref(h, K2_SALT)


def _to_unit(h):
    """32-bit hash (any int dtype, value or its int32 wrap) -> fp32 u in (0, 1)."""
    return ((h >> 1) & 0x7FFFFFFF).float().add_(0.5).mul_(2.0 ** -31).clamp_max_(U_MAX)


def uniform_noise_ref(seeds, offsets, n: int):
    """The noise spec: u(seed_b, offset_b, j) for j < n, (B, n) fp32 in (0, 1)."""
    k1, k2 = row_keys_ref(seeds, offsets)
    j = torch.arange(n, device=seeds.device)
    h = _fmix32_ref((k1[:, None] + ((j * GOLD) & M32)) & M32)  # (B, n)
    return _to_unit(_fmix32_ref(h ^ k2[:, None]))


# ---- the hash, fast: int32 tensors wrap mod 2^32; logical shifts by masking ----

def to_i32(x):
    """int64 values in [0, 2^32) -> the int32 with the same bits."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


_C1_I32, _C2_I32 = FMIX_C1 - 2**32, FMIX_C2 - 2**32


def _xorshift_(h, by: int, tmp):
    """h ^= h >> by (logical) in place; tmp: a scratch tensor like h."""
    torch.bitwise_right_shift(h, by, out=tmp)
    h ^= tmp.bitwise_and_((1 << (32 - by)) - 1)  # clear the sign copies of the arithmetic shift


def _fmix32_i32_(h, tmp):
    """In place on an int32 tensor."""
    _xorshift_(h, 16, tmp)
    h *= _C1_I32
    _xorshift_(h, 13, tmp)
    h *= _C2_I32
    _xorshift_(h, 16, tmp)
    return h


def noise_i32(k1, k2, jg):
    """Row keys (R,) int32 and jg = j * GOLD (n,) int32 -> u (R, n) fp32."""
    h = k1[:, None] + jg[None, :]  # (R, n) int32, wraps
    tmp = torch.empty_like(h)
    _fmix32_i32_(h, tmp)
    h ^= k2[:, None]
    return _to_unit(_fmix32_i32_(h, tmp))


def weyl_i32(n: int, device):
    return to_i32((torch.arange(n, device=device, dtype=torch.int64) * GOLD) & M32)


def uniform_noise_torch(seeds, offsets, n: int):
    k1, k2 = row_keys_ref(seeds, offsets)
    return noise_i32(to_i32(k1), to_i32(k2), weyl_i32(n, seeds.device))


@triton.jit
def _fmix32(h):  # uint32
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit
def _absorb(h, w):
    return _fmix32((h ^ w) + 0x9E3779B9)


@triton.jit
def row_keys(seed, off):
    """int64 scalars -> (k1, k2) uint32."""
    h = _absorb((seed & 0xFFFFFFFF).to(tl.uint32), 0x6A09E667)
    h = _absorb(h, ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    h = _absorb(h, (off & 0xFFFFFFFF).to(tl.uint32))
    h = _absorb(h, ((off >> 32) & 0xFFFFFFFF).to(tl.uint32))
    return h, _absorb(h, 0x243F6A88)


@triton.jit
def uniform(k1, k2, j):
    """(BLOCK,) int32 vocab ids -> u (BLOCK,) fp32 in (0, 1)."""
    h = _fmix32(_fmix32(k1 + j.to(tl.uint32) * 0x9E3779B9) ^ k2)
    u = ((h >> 1).to(tl.float32) + 0.5) * 4.656612873077393e-10  # 2^-31
    return tl.minimum(u, 0.9999999403953552)  # 1 - 2^-24


@triton.jit
def _uniform_kernel(seed_ptr, off_ptr, out_ptr, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    k1, k2 = row_keys(tl.load(seed_ptr + row), tl.load(off_ptr + row))
    tl.store(out_ptr + row.to(tl.int64) * n + j, uniform(k1, k2, j), mask=j < n)


def uniform_noise_triton(seeds, offsets, n: int):
    B = seeds.shape[0]
    out = torch.empty(B, n, dtype=torch.float32, device=seeds.device)
    if B and n:
        block = min(1024, next_pow2(n))
        _uniform_kernel[(B, triton.cdiv(n, block))](seeds.long().contiguous(), offsets.long().contiguous(),
                                                    out, n, BLOCK=block)
    return out


def uniform_noise(seeds, offsets, n: int, backend: str = "auto"):
    """u(seed_b, offset_b, j) for j < n: (B, n) fp32 in (0, 1); the same bits from every backend."""
    impl = {"triton": uniform_noise_triton, "torch": uniform_noise_torch,
            "ref": uniform_noise_ref}[choose(backend, seeds, offsets)]
    return impl(seeds, offsets, n)
