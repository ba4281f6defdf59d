"""Log-prob + entropy fused with the output layer: hidden @ weight.T never fully materialized.

Spec (`linear_logprob_ref`): logprob_entropy_ref(hidden @ weight.T, targets).
hidden (N, H) is replicated over the TP group (the input of Megatron's
column-parallel output layer without sequence parallelism); weight (V/tp, H)
is this rank's vocab shard. Tokens go in chunks: each chunk's logits
(n, V/tp) live only while its stats (forward) or gradient (backward) are
computed, the backward recomputes them, and grad_hidden is all-reduced over
the TP group (the sum of every shard's contribution). The per-chunk
log-prob/entropy math is `logprob.local_stats` / `local_grad` (Triton or
torch by backend); the matmuls are torch.
"""
import torch
import torch.distributed as dist

from megarl_kernels.dispatch import choose
from megarl_kernels.logprob import (local_grad, local_stats, logprob_entropy_ref, reduce_over_tp, tp_size,
                                    vocab_start)

# Logits bytes per token chunk: 512 MiB -> 1765 tokens at V=152064 bf16, a
# matmul large enough to stay compute bound. Unswept.
CHUNK_BYTES = 1 << 29


def linear_logprob_ref(hidden, weight, targets, tp_group=None, temperature: float = 1.0):
    """The spec: full logits, then logprob_entropy_ref. Returns fp32 (N,), (N,)."""
    return logprob_entropy_ref(hidden @ weight.t(), targets, tp_group, temperature)


def _chunks(n: int, v_local: int, elem: int, chunk_tokens):
    step = chunk_tokens or max(1, CHUNK_BYTES // max(v_local * elem, 1))
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


class LinearLogprob(torch.autograd.Function):
    """(hidden (N, H), weight (V/tp, H), targets (N,)) -> (logprob (N,), entropy (N,))."""

    @staticmethod
    def forward(ctx, hidden, weight, tgt, group, temperature, chunk_tokens, backend):
        n, v = hidden.shape[0], weight.shape[0]
        start, inv_t = vocab_start(v, group), 1.0 / temperature
        lp, ent, lse, ez = (torch.empty(n, dtype=torch.float32, device=hidden.device) for _ in range(4))
        ctx.chunks = _chunks(n, v, hidden.element_size(), chunk_tokens)
        for sl in ctx.chunks:
            logits = hidden[sl] @ weight.t()  # (n_c, V/tp)
            lse[sl], ez[sl], ent[sl], zt = reduce_over_tp(local_stats(logits, tgt[sl], start, inv_t, backend), group)
            lp[sl] = zt - lse[sl]
        ctx.save_for_backward(hidden, weight, tgt, lse, ez)
        ctx.group, ctx.start, ctx.inv_t, ctx.backend = group, start, inv_t, backend
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, tgt, lse, ez = ctx.saved_tensors
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.float().contiguous()
        g_ent = torch.zeros_like(lse) if g_ent is None else g_ent.float().contiguous()
        grad_h = torch.empty_like(hidden)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for sl in ctx.chunks:
            logits = hidden[sl] @ weight.t()  # (n_c, V/tp), recomputed
            g = local_grad(logits, tgt[sl], ctx.start, ctx.inv_t, lse[sl], ez[sl], g_lp[sl], g_ent[sl],
                           ctx.backend)
            grad_h[sl] = g @ weight
            grad_w += g.t() @ hidden[sl]
        if tp_size(ctx.group) > 1:
            dist.all_reduce(grad_h, group=ctx.group)
        return grad_h, grad_w.to(weight.dtype), None, None, None, None, None


def linear_logprob(hidden, weight, targets, tp_group=None, temperature: float = 1.0,
                   chunk_tokens: int | None = None, backend: str = "auto"):
    """logprob_entropy(hidden @ weight.T, targets) without materializing the logits.

    hidden: (..., H) replicated over tp_group; weight: (V/tp, H) this rank's
    shard; targets: (...) global ids. chunk_tokens: tokens per chunk (default:
    512 MiB of logits). Returns (logprob, entropy), each (...) fp32.
    """
    impl = choose(backend, hidden, weight, targets)
    if impl == "ref":
        return linear_logprob_ref(hidden, weight, targets, tp_group, temperature)
    h = hidden.reshape(-1, hidden.shape[-1]).contiguous()  # (N, H)
    lp, ent = LinearLogprob.apply(h, weight, targets.reshape(-1).contiguous(), tp_group, float(temperature),
                                  chunk_tokens, impl)
    return lp.view(targets.shape), ent.view(targets.shape)
