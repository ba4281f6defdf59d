"""Packed (THD) causal attention, forward + backward: flash varlen against cuDNN, ragged and padded.

    python3 benchmarks/bench_packed_attention.py --out $OUT/packed_attention.json     # one CUDA GPU

The training forward's attention over one token-budget micro-batch of packed sequences
(the actor update's workload in bench_train.py: lengths 64 + U(64, 2048), one bin of at most
``--tokens`` tokens), Qwen2.5-1.5B layer (12 query heads, 2 KV heads, head dim 128, bf16).
Providers, each forward + backward of the same q, k, v, dout, timed with CUDA events
(median of ``--iters`` after warm-up), outputs and gradients compared with flash varlen:
- ``flash_varlen``: ``torch.nn.attention.varlen.varlen_attn`` (what megarl runs today);
- ``cudnn_ragged``: aten's cuDNN attention with ragged offsets (cum_seq_q / cum_seq_k);
- ``cudnn_padded``: rows scattered into a (b, max_len) batch, causal SDPA (cuDNN), gathered;
and, for scale, ``cudnn_dense_only``: the SDPA alone on rows already padded (not a drop-in).
Measured on an H200 (benchmarks/RESULTS.md, session 7): flash varlen 7.79 ms over the five bins,
cuDNN padded 7.55, cuDNN on padded rows alone 4.93; the ragged cuDNN entry gave wrong gradients
at ~130 ms a call. megarl keeps flash varlen.
"""
from __future__ import annotations

import argparse
import json
import statistics

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def bins_of(tokens: int, seed: int, sequences: int = 64) -> list[list[int]]:
    """bench_train's lengths (64 + U(64, 2048)) in first-fit-decreasing bins of ``tokens``."""
    g = torch.Generator().manual_seed(seed)
    bins: list[list[int]] = []
    for n in sorted((64 + torch.randint(64, 2049, (sequences,), generator=g)).tolist(), reverse=True):
        fit = next((b for b in bins if sum(b) + n <= tokens), None)
        (fit.append(n) if fit is not None else bins.append([n]))
    return bins


def flash_varlen(q, k, v, cu, max_len, scale):
    from megarl.models.packed_attention import packed_attention_varlen

    return packed_attention_varlen(q, k, v, cu, cu, max_len, max_len, True, scale)


class CudnnRagged(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu, max_len, scale):
        res = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, max_len, max_len, True, 0.0, True,
                                                      False, scale=scale)
        out, lse, seed, offset = res[0], res[1], res[6], res[7]
        ctx.save_for_backward(q, k, v, out, lse, cu, seed, offset)
        ctx.max_len, ctx.scale = max_len, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu, seed, offset = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
            dout.contiguous(), q, k, v, out, lse, seed, offset, None, cu, cu, ctx.max_len, ctx.max_len, 0.0, True,
            scale=ctx.scale)
        return dq, dk, dv, None, None, None


def cudnn_ragged(q, k, v, cu, max_len, scale):
    return CudnnRagged.apply(q, k, v, cu, max_len, scale)


def cudnn_ragged_mha(q, k, v, cu, max_len, scale):
    g = q.shape[1] // k.shape[1]
    return CudnnRagged.apply(q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1), cu, max_len, scale)


class JaggedToPadded(torch.autograd.Function):
    """(t, f) rows of sequences at offsets -> (b, max_len, f) zero-padded; backward the inverse."""

    @staticmethod
    def forward(ctx, x, offsets, max_len):
        ctx.save_for_backward(offsets)
        ctx.t = x.shape[0]
        return torch.ops.aten._jagged_to_padded_dense_forward(x, [offsets], [max_len], 0.0)

    @staticmethod
    def backward(ctx, grad):
        (offsets,) = ctx.saved_tensors
        return torch.ops.aten._padded_dense_to_jagged_forward(grad.contiguous(), [offsets], ctx.t), None, None


class PaddedToJagged(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dense, offsets, t):
        ctx.save_for_backward(offsets)
        ctx.max_len = dense.shape[1]
        return torch.ops.aten._padded_dense_to_jagged_forward(dense, [offsets], t)

    @staticmethod
    def backward(ctx, grad):
        (offsets,) = ctx.saved_tensors
        return torch.ops.aten._jagged_to_padded_dense_forward(grad.contiguous(), [offsets], [ctx.max_len], 0.0), None, None


def cudnn_padded(q, k, v, cu, max_len, scale):
    t, offsets = q.shape[0], cu.long()

    def pad(x):  # (t, h, d) -> (b, h, max_len, d)
        dense = JaggedToPadded.apply(x.reshape(t, -1), offsets, max_len)
        return dense.view(dense.shape[0], max_len, *x.shape[1:]).transpose(1, 2)

    o = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), is_causal=True, scale=scale, enable_gqa=True)
    o = o.transpose(1, 2).reshape(o.shape[0], max_len, -1)
    return PaddedToJagged.apply(o, offsets, t).view(q.shape)


PROVIDERS = {"flash_varlen": flash_varlen, "cudnn_ragged": cudnn_ragged, "cudnn_ragged_mha": cudnn_ragged_mha,
             "cudnn_padded": cudnn_padded}


def run(fn, q, k, v, dout, cu, max_len, scale):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v, cu, max_len, scale)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def timed(step, iters: int) -> float:
    """Median ms of ``step()`` over ``iters`` calls after 3 warm-up calls (CUDA events)."""
    times = []
    for _ in range(iters + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[3:])


def dense_step(dense) -> None:
    """fwd + bwd of causal SDPA on already padded (b, h, L, d) rows: the padded layout's attention alone."""
    out = F.scaled_dot_product_attention(*dense, is_causal=True, enable_gqa=True)
    out.backward(torch.ones_like(out))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default="packed_attention.json")
    args = ap.parse_args()
    print("schemas:", torch.ops.aten._cudnn_attention_forward.default._schema, "|",
          torch.ops.aten._cudnn_attention_backward.default._schema, flush=True)
    rows = []
    for i, lens in enumerate(bins_of(args.tokens, 0)):  # the actor update's bins (bench_train.py)
        t, dev = sum(lens), "cuda"
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
        g = torch.Generator(device=dev).manual_seed(i)
        q = torch.randn(t, 12, 128, device=dev, dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(t, 2, 128, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
        dout = torch.randn_like(q)
        inputs = (q, k, v, dout, cu, max(lens), 128 ** -0.5)
        want = run(flash_varlen, *inputs)
        flops = sum(4 * 12 * 128 * n * n / 2 for n in lens) * 3.5  # fwd + bwd (2.5x fwd), causal
        for name, fn in PROVIDERS.items():
            row = {"provider": name, "bin": i, "tokens": t, "sequences": len(lens), "max_len": max(lens)}
            try:
                got = run(fn, *inputs)
                row["max_abs_diff"] = [float((a.float() - b.float()).abs().max()) for a, b in zip(got, want)]
                row["ms"] = timed(lambda: run(fn, *inputs), args.iters)  # noqa: B023 (called at once)
                row["tflops"] = flops / row["ms"] / 1e9
            except Exception as e:  # noqa: BLE001 (a provider this torch / cuDNN cannot run)
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            print(row, flush=True)
        dense = [x.new_zeros(len(lens), x.shape[1], max(lens), 128).requires_grad_() for x in (q, k, v)]
        rows.append({"provider": "cudnn_dense_only", "bin": i, "ms": timed(lambda: dense_step(dense), args.iters)})
        print(rows[-1], flush=True)
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                   "gpu": torch.cuda.get_device_name()}, f, indent=1)


if __name__ == "__main__":
    main()
