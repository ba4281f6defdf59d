"""RoPE on the fused QKV projection and the K/V write into the paged cache, in one pass.

Spec (`rope_cache_ref`). qkv (T, ng * (G + 2) * D) is megatron's fused
projection output: per key/value group, G query heads, then the key, then the
value; with ``bias`` (ng * (G + 2) * D,) it is the matmul's output and the bias
is added first, rounded as megatron's ``output + bias`` (the prefill's separate
add kernel, 3.6% of a 16k-token prefill's kernel time, folded in). cos, sin
(S, D) are megatron's tables already cast to the activation dtype; positions
(T,) index them. With rotate_half(t) = cat(-t[D/2:], t[:D/2]):
    q = t * cos + rotate_half(t) * sin        each product and the sum rounded
    k = same on the key                       to the activation dtype, as
                                              megatron's bshd RoPE computes them
    k_cache.view(-1, ng, D)[slot_mapping] = k;  v_cache likewise with v
returns q (T, ng * G, D). k_cache, v_cache: (pages, page_size, ng, D),
contiguous; slot_mapping (T,) = page * page_size + offset of each token.

Kernel: grid (T, ng); a program loads its group's G + 2 head vectors once,
rotates G + 1 of them, writes q and the cache rows. Unfused this is ~12
elementwise launches and two index copies per layer.
"""
import torch

from megarl_kernels.dispatch import choose, next_pow2, tl, triton


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cache_ref(qkv, cos, sin, positions, slot_mapping, k_cache, v_cache, groups: int, q_per_group: int,
                   bias=None):
    """The spec; writes k_cache / v_cache in place and returns q (T, ng * G, D)."""
    t, d = qkv.shape[0], k_cache.shape[-1]
    if bias is not None:
        qkv = qkv + bias
    qkv = qkv.view(t, groups, q_per_group + 2, d)
    c, s = cos[positions][:, None], sin[positions][:, None]  # (T, 1, D)
    q = qkv[:, :, :q_per_group].reshape(t, groups * q_per_group, d)
    k, v = qkv[:, :, q_per_group], qkv[:, :, q_per_group + 1]
    q = q * c + _rotate_half(q) * s
    k = k * c + _rotate_half(k) * s
    k_cache.view(-1, groups, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, groups, d).index_copy_(0, slot_mapping, v.contiguous())
    return q


@triton.jit
def rope_tables(cos_ptr, sin_ptr, pos, stride_cs, d, D: tl.constexpr):
    """cos, sin rows of position ``pos`` at columns d, in fp32 (0 past D)."""
    c = tl.load(cos_ptr + pos * stride_cs + d, mask=d < D, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_cs + d, mask=d < D, other=0.0).to(tl.float32)
    return c, s


@triton.jit
def qkv_values(ptrs, bias_ptrs, ok, part_stride, dtype: tl.constexpr, PARTS: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Fused-QKV values at ``ptrs``: the row's own (PARTS 0), or the sum of PARTS fp32 split-K
    partials ``part_stride`` apart in order, rounded to dtype; then + bias, rounded again
    (megatron's column-parallel linear: the matmul's output, then ``output + bias``)."""
    x = tl.load(ptrs, mask=ok, other=0.0)
    if PARTS > 0:
        for p in tl.static_range(1, PARTS):
            x += tl.load(ptrs + p * part_stride, mask=ok, other=0.0)
    x = x.to(dtype)
    if HAS_BIAS:
        x = (x.to(tl.float32) + tl.load(bias_ptrs, mask=ok, other=0.0).to(tl.float32)).to(dtype)
    return x


@triton.jit
def rope_rows(ptrs, bias_ptrs, d, ok, c, s, part_stride, dtype: tl.constexpr, D: tl.constexpr,
              PARTS: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Head vectors x at ``ptrs + d`` (`qkv_values`) and the spec's RoPE of them (products and sum
    rounded to dtype)."""
    x = qkv_values(ptrs + d, bias_ptrs + d, ok, part_stride, dtype, PARTS, HAS_BIAS)
    half = D // 2
    rd = tl.where(d < half, d + half, d - half)
    xr = qkv_values(ptrs + rd, bias_ptrs + rd, ok, part_stride, dtype, PARTS, HAS_BIAS).to(tl.float32)
    xr = tl.where(d < half, -xr, xr)
    a = (x.to(tl.float32) * c).to(dtype).to(tl.float32)  # t * cos, rounded
    b = (xr * s).to(dtype).to(tl.float32)  # rotate_half(t) * sin, rounded
    return x, (a + b).to(dtype)


@triton.jit
def _rope_cache_kernel(qkv_ptr, bias_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr, k_ptr, v_ptr,
                       stride_qkv, stride_cs, G: tl.constexpr, D: tl.constexpr,
                       G2: tl.constexpr, BLOCK_D: tl.constexpr, HAS_BIAS: tl.constexpr):
    t = tl.program_id(0)
    j = tl.program_id(1)
    ng = tl.num_programs(1)
    heads = tl.arange(0, G2)[:, None]  # (G2, 1): G query heads, the key, the value
    d = tl.arange(0, BLOCK_D)[None, :]  # (1, BD)
    ok = (heads < G + 2) & (d < D)
    c, s = rope_tables(cos_ptr, sin_ptr, tl.load(pos_ptr + t), stride_cs, d, D)
    cols = (j * (G + 2) + heads) * D
    x, rot = rope_rows(qkv_ptr + t * stride_qkv + cols, bias_ptr + cols, d, ok, c, s, 0, q_ptr.dtype.element_ty, D,
                       0, HAS_BIAS)
    tl.store(q_ptr + t * ng * G * D + (j * G + heads) * D + d, rot, mask=ok & (heads < G))
    slot = tl.load(slot_ptr + t).to(tl.int64)
    row = slot * ng * D + j * D + d
    tl.store(k_ptr + row + heads * 0, rot, mask=ok & (heads == G))
    tl.store(v_ptr + row + heads * 0, x, mask=ok & (heads == G + 1))


def rope_cache_triton(qkv, cos, sin, positions, slot_mapping, k_cache, v_cache, groups: int, q_per_group: int,
                      bias=None):
    t, d = qkv.shape[0], k_cache.shape[-1]
    q = torch.empty(t, groups * q_per_group, d, dtype=qkv.dtype, device=qkv.device)
    if t:
        _rope_cache_kernel[(t, groups)](qkv, qkv if bias is None else bias, cos, sin, positions, slot_mapping, q,
                                        k_cache, v_cache, qkv.stride(0), cos.stride(0), G=q_per_group, D=d,
                                        G2=next_pow2(q_per_group + 2), BLOCK_D=next_pow2(d),
                                        HAS_BIAS=bias is not None, num_warps=4)
    return q


def check_rope_inputs(qkv, k_cache, v_cache, op: str) -> None:
    """What the RoPE + cache-write kernels need: contiguous caches, dense qkv rows, an even head_dim."""
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and qkv.stride(-1) == 1):
        raise ValueError(f"{op}: the caches must be contiguous and qkv rows dense")
    if k_cache.shape[-1] % 2:
        raise ValueError(f"{op}: head_dim {k_cache.shape[-1]} must be even")


def rope_cache(qkv, cos, sin, positions, slot_mapping, k_cache, v_cache, groups: int, q_per_group: int,
               backend: str = "auto", bias=None):
    """RoPE'd queries (T, ng * G, D); the step's keys and values written into the cache. bias: the
    fused projection's (ng * (G + 2) * D,) bias, added to qkv first (module docstring), or None."""
    check_rope_inputs(qkv, k_cache, v_cache, "rope_cache")
    if bias is not None and tuple(bias.shape) != (qkv.shape[-1],):
        raise ValueError(f"rope_cache: bias must be ({qkv.shape[-1]},), got {tuple(bias.shape)}")
    backend = choose(backend, qkv, cos, k_cache)
    fn = rope_cache_triton if backend == "triton" else rope_cache_ref  # the spec is already vectorized
    return fn(qkv, cos, sin, positions, slot_mapping, k_cache, v_cache, groups, q_per_group, bias=bias)
