"""Log-prob of the chosen token and entropy from vocab-parallel logits.

Spec (`logprob_entropy_ref`). logits (N, V/tp) is this rank's vocab shard,
columns [r*V/tp, (r+1)*V/tp) for TP rank r (tp_group None = TP1); targets (N,)
are global token ids. With z = logits / temperature over the full vocab:
    logprob_n = z[n, targets_n] - logsumexp(z[n])          (N,) fp32
    entropy_n = -sum_v p[n, v] log p[n, v],  p = softmax(z[n])
The gradient w.r.t. a shard is the gradient of the replicated outputs w.r.t.
that shard (no sum over ranks), as in Megatron's vocab-parallel cross entropy.

How. Each rank streams its shard in BLOCK_V chunks keeping per-row running
    m = max z,   s = sum exp(z - m),   w = sum exp(z - m) (z - m)
(fp32; w relative to m avoids cancelling in the entropy), plus the target's z
if this rank owns it. Shards merge with one all_reduce(MAX) of m and one
all_reduce(SUM) of (s, w, z_target) rescaled to the global m; then
    lse = m + log s,  E[z] = m + w / s,  entropy = log s - w / s.
Backward recomputes p = exp(z - lse) chunk-wise (no communication):
    d logprob / dz = onehot - p,   d entropy / dz = p (E[z] - z),
and writes grad_logits = (g_lp (onehot - p) + g_ent p (E[z] - z)) / temperature
in the logits' dtype. Nothing (N, V) in fp32 is ever allocated.
"""
import torch
import torch.distributed as dist

from megarl_kernels.dispatch import choose, next_pow2, tl, triton

# Vocab chunk per loop step: 4096 bf16 = 16 per thread at 8 warps (two 16 B
# loads). Not tuned; `benchmarks/bench_kernels.py` sweeps 2048/4096/8192. Any vocab size
# is correct (the last chunk is masked).
BLOCK_V = 4096
NUM_WARPS = 8
# torch backend: rows per chunk so one fp32 temporary is <= 2^24 elements (64 MiB).
TORCH_CHUNK_ELEMS = 1 << 24


def tp_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def vocab_start(v_local: int, group) -> int:
    """First global vocab id of this rank's shard."""
    return 0 if group is None else dist.get_rank(group) * v_local


class _GatherVocab(torch.autograd.Function):
    """(N, V/tp) shards -> (N, V); backward keeps this rank's slice (the Megatron convention)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.v_local = group, x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(tp_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        start = vocab_start(ctx.v_local, ctx.group)
        return grad[..., start:start + ctx.v_local].contiguous(), None


def logprob_entropy_ref(logits, targets, tp_group=None, temperature: float = 1.0):
    """The spec: log_softmax over the gathered vocab, gather, entropy. Returns fp32 (N,), (N,)."""
    if tp_size(tp_group) > 1:
        logits = _GatherVocab.apply(logits, tp_group)  # (N, V)
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # (N, V) fp32
    lp = logp.gather(-1, targets[..., None]).squeeze(-1)
    return lp, -(logp.exp() * logp).sum(-1)


# ---- torch backend: the same streaming math, chunked over rows ----

def _rows(n_rows: int, v: int):
    step = max(1, TORCH_CHUNK_ELEMS // max(v, 1))
    return [slice(i, min(i + step, n_rows)) for i in range(0, n_rows, step)]


def _local_stats_torch(x, tgt, start: int, inv_temp: float):
    """(N, V/tp) -> (4, N) fp32 rows (m, s, w, z_target or 0)."""
    out = torch.empty(4, x.shape[0], dtype=torch.float32, device=x.device)
    v = x.shape[1]
    for sl in _rows(x.shape[0], v):
        z = x[sl].float() * inv_temp  # (n, V/tp)
        m = z.amax(-1, keepdim=True)
        e = torch.exp(z - m)
        local = tgt[sl] - start
        owned = (local >= 0) & (local < v)
        out[0, sl], out[1, sl], out[2, sl] = m[:, 0], e.sum(-1), (e * (z - m)).sum(-1)
        out[3, sl] = torch.where(owned, z.gather(-1, local.clamp(0, v - 1)[:, None])[:, 0], 0.0)
    return out


def _local_grad_torch(x, tgt, start: int, inv_temp: float, lse, ez, g_lp, g_ent):
    """grad w.r.t. the (N, V/tp) shard, in x.dtype."""
    grad = torch.empty_like(x)
    v = x.shape[1]
    for sl in _rows(x.shape[0], v):
        z = x[sl].float() * inv_temp  # (n, V/tp)
        p = torch.exp(z - lse[sl, None])
        g = p * (g_ent[sl, None] * (ez[sl, None] - z) - g_lp[sl, None])
        local = tgt[sl] - start
        owned = (local >= 0) & (local < v)
        g.scatter_add_(-1, local.clamp(0, v - 1)[:, None], torch.where(owned, g_lp[sl], 0.0)[:, None])
        grad[sl] = g * inv_temp
    return grad


# ---- Triton backend: one program per row, streaming the shard ----

@triton.jit
def _stats_kernel(x_ptr, stride, tgt_ptr, out_ptr, N, V, start, inv_temp, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    xr = x_ptr + row.to(tl.int64) * stride
    cols = tl.arange(0, BLOCK_V)
    m = -1e30  # finite: (m - m_new) * s stays 0 on the first chunk
    s = 0.0
    w = 0.0
    for v0 in range(0, V, BLOCK_V):
        ok = v0 + cols < V
        z = tl.load(xr + v0 + cols, mask=ok, other=float("-inf")).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, tl.max(z, 0))
        e = tl.exp(z - m_new)  # 0 where masked
        alpha = tl.exp(m - m_new)
        w = alpha * (w + (m - m_new) * s) + tl.sum(e * tl.where(ok, z - m_new, 0.0), 0)
        s = alpha * s + tl.sum(e, 0)
        m = m_new
    local = tl.load(tgt_ptr + row) - start
    owned = (local >= 0) & (local < V)
    zt = tl.load(xr + tl.where(owned, local, 0), mask=owned, other=0.0).to(tl.float32) * inv_temp
    tl.store(out_ptr + row, m)
    tl.store(out_ptr + N + row, s)
    tl.store(out_ptr + 2 * N + row, w)
    tl.store(out_ptr + 3 * N + row, tl.where(owned, zt, 0.0))


@triton.jit
def _grad_kernel(x_ptr, stride, g_ptr, tgt_ptr, lse_ptr, ez_ptr, glp_ptr, gent_ptr, V, start, inv_temp,
                 BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    xr = x_ptr + row.to(tl.int64) * stride
    gr = g_ptr + row.to(tl.int64) * V
    lse = tl.load(lse_ptr + row)
    ez = tl.load(ez_ptr + row)
    g_lp = tl.load(glp_ptr + row)
    g_ent = tl.load(gent_ptr + row)
    local = tl.load(tgt_ptr + row) - start
    cols = tl.arange(0, BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        ok = v0 + cols < V
        z = tl.load(xr + v0 + cols, mask=ok, other=0.0).to(tl.float32) * inv_temp
        p = tl.exp(z - lse)
        g = p * (g_ent * (ez - z) - g_lp) + tl.where(v0 + cols == local, g_lp, 0.0)
        tl.store(gr + v0 + cols, (g * inv_temp).to(g_ptr.dtype.element_ty), mask=ok)


def _block_v(v: int) -> int:
    return min(BLOCK_V, next_pow2(v))


def _local_stats_triton(x, tgt, start: int, inv_temp: float):
    n, v = x.shape
    out = torch.empty(4, n, dtype=torch.float32, device=x.device)
    if n:
        _stats_kernel[(n,)](x, x.stride(0), tgt, out, n, v, start, inv_temp,
                            BLOCK_V=_block_v(v), num_warps=NUM_WARPS)
    return out


def _local_grad_triton(x, tgt, start: int, inv_temp: float, lse, ez, g_lp, g_ent):
    n, v = x.shape
    grad = torch.empty(n, v, dtype=x.dtype, device=x.device)
    if n:
        _grad_kernel[(n,)](x, x.stride(0), grad, tgt, lse, ez, g_lp, g_ent, v, start, inv_temp,
                           BLOCK_V=_block_v(v), num_warps=NUM_WARPS)
    return grad


def local_stats(x, tgt, start: int, inv_temp: float, backend: str):
    """Per-row (m, s, w, z_target) of one shard: (N, V/tp) -> (4, N) fp32."""
    return (_local_stats_triton if backend == "triton" else _local_stats_torch)(x, tgt, start, inv_temp)


def local_grad(x, tgt, start: int, inv_temp: float, lse, ez, g_lp, g_ent, backend: str):
    """Gradient w.r.t. one (N, V/tp) shard, in x.dtype."""
    fn = _local_grad_triton if backend == "triton" else _local_grad_torch
    return fn(x, tgt, start, inv_temp, lse, ez, g_lp, g_ent)


def reduce_over_tp(stats, group):
    """(4, N) local (m, s, w, z_t) -> global (lse, E[z], entropy, z_target), each (N,)."""
    m, s, w, zt = stats.unbind(0)
    if tp_size(group) > 1:
        gm = m.clone()
        dist.all_reduce(gm, op=dist.ReduceOp.MAX, group=group)
        a = torch.exp(m - gm)
        part = torch.stack([a * s, a * (w + (m - gm) * s), zt])  # (3, N) rescaled to the global max
        dist.all_reduce(part, group=group)
        m, (s, w, zt) = gm, part.unbind(0)
    log_s, mean_dz = torch.log(s), w / s
    return m + log_s, m + mean_dz, log_s - mean_dz, zt


def _grads_or_zeros(g, like):
    return torch.zeros_like(like) if g is None else g.reshape(-1).float().contiguous()


class LogprobEntropy(torch.autograd.Function):
    """(logits (N, V/tp), targets (N,)) -> (logprob (N,), entropy (N,)), both differentiable."""

    @staticmethod
    def forward(ctx, x, tgt, group, temperature, backend):
        start, inv_t = vocab_start(x.shape[1], group), 1.0 / temperature
        lse, ez, ent, zt = reduce_over_tp(local_stats(x, tgt, start, inv_t, backend), group)
        ctx.save_for_backward(x, tgt, lse, ez)
        ctx.start, ctx.inv_t, ctx.backend = start, inv_t, backend
        return zt - lse, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        x, tgt, lse, ez = ctx.saved_tensors
        g_lp, g_ent = _grads_or_zeros(g_lp, lse), _grads_or_zeros(g_ent, lse)
        grad = local_grad(x, tgt, ctx.start, ctx.inv_t, lse, ez, g_lp, g_ent, ctx.backend)
        return grad, None, None, None, None


def logprob_entropy(logits, targets, tp_group=None, temperature: float = 1.0, backend: str = "auto"):
    """Per-token log-prob of `targets` and entropy from this rank's vocab shard.

    logits: (..., V/tp) any float dtype (bf16 fine), shard of rank r covers ids
    [r*V/tp, (r+1)*V/tp); targets: (...) int global ids; tp_group: the TP
    process group or None. Returns (logprob, entropy), each (...) fp32,
    differentiable w.r.t. logits (grad in logits.dtype).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    impl = choose(backend, logits, targets)
    if impl == "ref":
        return logprob_entropy_ref(logits, targets, tp_group, temperature)
    x = logits.reshape(-1, logits.shape[-1])  # (N, V/tp)
    if x.stride(-1) != 1:
        x = x.contiguous()
    lp, ent = LogprobEntropy.apply(x, targets.reshape(-1).contiguous(), tp_group, float(temperature), impl)
    return lp.view(targets.shape), ent.view(targets.shape)
