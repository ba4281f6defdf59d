"""Benchmark the fused MoE experts (megarl_kernels.fused_moe) on the Qwen3-30B-A3B expert shape.

    python benchmarks/bench_moe_kernels.py --out moe_kernels.json            # CUDA
    python benchmarks/bench_moe_kernels.py --tokens 32,256 --sweep --out moe_sweep.json

One MoE layer's experts: hidden 2048, 128 experts of FFN 768, top-8, bf16, routing from random
logits (Qwen3 softmax / top-k / renormalize), at T tokens. Providers, on the same inputs:
  fused        `fused_moe` (the two Triton launches over expert-sorted blocks + the sum over k)
  torch        `fused_moe_torch` (slots padded per expert, two torch.bmm: the reference-style path)
  loop         a Python loop over the selected experts (gather, F.linear, silu_mul, F.linear,
               index_add_: what transformers' eager experts do)
Per row: median ms (CUDA events, after warm-up), fused also as a CUDA graph replay (launch overhead
excluded), and GB/s over the bytes a call must move: the selected experts' weights (each selected
expert's w13 and w2 once) plus hidden in and out; its fraction of the 4.24 TB/s H200 floor. The
layer's 1.2 GB of experts is 20x the L2, so the weights are read from HBM on every call. Each row
records the fused output's largest difference from the torch path. The expert-sorted layout alone
is timed both ways (one-program kernel, torch ops; CUDA graph replays): the evidence for
moe_align.KERNEL_MAX_SLOTS. ``--sweep`` times the fused path at other BLOCK_M and tiles (the
evidence for the constants in fused_moe.py).
CUDA only: on a CPU it prints why and exits.
"""
import argparse
import importlib
import json
import statistics
import sys

import torch
import torch.nn.functional as F

HBM_BYTES_PER_S = 4.24e12
DEV = "cuda"  # the kernels are timed on CUDA; a smoke check of the setup may set "cpu"
SHAPE = dict(hidden=2048, ffn=768, experts=128, top_k=8)


def layer(tokens, hidden, ffn, experts, top_k, seed=0):
    """hidden (T, H), w13 (E, 2F, H), w2 (E, H, F) in bf16, Qwen3 routing of random logits."""
    from megarl_kernels import moe_route

    g = torch.Generator(device=DEV).manual_seed(seed)
    randn = lambda *s, scale=1.0: (torch.randn(*s, generator=g, device=DEV) * scale).bfloat16()  # noqa: E731
    x = randn(tokens, hidden)
    w13 = randn(experts, 2 * ffn, hidden, scale=hidden ** -0.5)
    w2 = randn(experts, hidden, ffn, scale=ffn ** -0.5)
    weights, ids = moe_route(torch.randn(tokens, experts, generator=g, device=DEV), top_k, "qwen3_moe")
    return x, w13, w2, weights, ids


def per_expert_loop(x, w13, w2, weights, ids):
    """The eager baseline: one gather + two GEMMs + index_add_ per selected expert."""
    from megarl_kernels import silu_mul

    k = ids.shape[1]
    flat, flat_w = ids.reshape(-1), weights.reshape(-1)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in flat.unique().tolist():
        slots = (flat == e).nonzero().squeeze(1)
        y = F.linear(silu_mul(F.linear(x[slots // k], w13[e]), backend="torch"), w2[e])
        out.index_add_(0, slots // k, y.float() * flat_w[slots, None])
    return out.to(x.dtype)


def moved_bytes(x, w13, w2, ids):
    """Bytes a call must move at least: every selected expert's weights once, hidden in and out."""
    selected = ids.unique().numel()
    return selected * (w13[0].numel() + w2[0].numel()) * w13.element_size() + 2 * x.numel() * x.element_size()


def eager_ms(fn, reps):
    fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        events.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def graph_ms(fn, reps):
    """ms per call replaying a CUDA graph of one call (the fused path never syncs with the host);
    None, with the reason printed, if the call cannot be captured."""
    try:
        return _graph_ms(fn, reps)
    except Exception as e:  # noqa: BLE001  (one provider that cannot be captured must not lose the run)
        print(f"    (no CUDA graph: {type(e).__name__}: {str(e)[:200]})")
        torch.cuda.synchronize()
        return None


def _graph_ms(fn, reps):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return eager_ms(graph.replay, reps)


def row(tokens, provider, ms, nbytes, **extra):
    if ms is None:
        return dict(tokens=tokens, provider=provider, ms=None, bytes=nbytes, **extra)
    r = dict(tokens=tokens, provider=provider, ms=ms, bytes=nbytes, gb_per_s=nbytes / ms / 1e6, **extra)
    r["frac_of_hbm_floor"] = r["gb_per_s"] * 1e9 / HBM_BYTES_PER_S
    print(f"  T={tokens:<5} {provider:<36} {ms:>9.4f} ms {r['gb_per_s']:>8.1f} GB/s {r['frac_of_hbm_floor']:>6.1%}"
          + "".join(f"  {k}={v}" for k, v in extra.items()))
    return r


def bench_tokens(tokens, reps, sweep):
    from megarl_kernels import fused_moe, fused_moe_torch

    fm = importlib.import_module("megarl_kernels.fused_moe")
    args = layer(tokens, **SHAPE)
    nbytes = moved_bytes(args[0], args[1], args[2], args[4])
    want = fused_moe_torch(*args)
    diff = (fused_moe(*args, backend="triton").float() - want.float()).abs().max().item()
    rows = [row(tokens, "fused", eager_ms(lambda: fused_moe(*args, backend="triton"), reps), nbytes,
                max_abs_diff_vs_torch=diff, selected_experts=args[4].unique().numel()),
            row(tokens, "fused (cuda graph)", graph_ms(lambda: fused_moe(*args, backend="triton"), reps), nbytes),
            row(tokens, "torch", eager_ms(lambda: fused_moe_torch(*args), reps), nbytes),
            row(tokens, "loop", eager_ms(lambda: per_expert_loop(*args), max(3, reps // 4)), nbytes)]
    ma = importlib.import_module("megarl_kernels.moe_align")
    block_m = fm.block_rows(args[4].numel(), SHAPE["experts"])
    for name, align in (("align kernel", ma.moe_align_triton), ("align torch", ma.moe_align_torch)):
        ms = graph_ms(lambda: align(args[4], SHAPE["experts"], block_m), reps)  # noqa: B023
        print(f"  T={tokens:<5} {name:<36} {ms if ms is None else round(ms, 4)} ms")
        rows.append(dict(tokens=tokens, provider=name, ms=ms, block_m=block_m))
    if sweep:
        for block_m in (16, 32, 64):
            for tiles in ((64, 64, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3), (128, 128, 8, 3), (64, 64, 4, 4)):
                fn = lambda: fm.fused_moe_triton(*args, block_m=block_m, gate_up_tiles=tiles, down_tiles=tiles)  # noqa: E731
                rows.append(row(tokens, f"fused bm={block_m} tiles={tiles}", graph_ms(fn, reps), nbytes,
                                block_m=block_m, tiles=list(tiles)))  # a tile that does not fit: ms None
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="32,128,256,2048", help="comma list of T (tokens in the batch)")
    ap.add_argument("--reps", type=int, default=20, help="timed calls per provider")
    ap.add_argument("--sweep", action="store_true", help="also time the fused path at other BLOCK_M and tiles")
    ap.add_argument("--out", default="moe_kernels.json", help="JSON results path")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_moe_kernels.py times the Triton MoE kernels on CUDA; no GPU here "
                 "(CPU correctness: pytest tests/test_kernel_fused_moe.py)")
    print(f"{torch.cuda.get_device_name()}  shape {SHAPE}  bf16")
    rows = [r for t in args.tokens.split(",") for r in bench_tokens(int(t), args.reps, args.sweep)]
    with open(args.out, "w") as f:
        json.dump(dict(shape=SHAPE, dtype="bfloat16", device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
