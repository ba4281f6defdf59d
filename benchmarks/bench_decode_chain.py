"""The decode layer's linears under cuBLAS against `decode_gemm` (TMA, dependent launch), on the H200.

    python3 benchmarks/bench_decode_chain.py --rows 128 --out $OUT/decode_chain.json

1. sweep: each linear of a B-row decode layer of the 1.5B shape alone (QKV and the output projection
   as split-K partials, fc1 with its SwiGLU, fc2 as partials), µs per call in a CUDA graph over weight
   copies that defeat the L2: today's form (cuBLAS `split_k_linear` at `split_parts`'s S, `F.linear` +
   `silu_mul`) against `decode_gemm` over tiles and split counts; max |diff| against today's output.
2. chain: 28 layers, each QKV -> output projection -> add + RMSNorm -> fc1 + SwiGLU -> fc2 -> add +
   RMSNorm (the attention left out), every layer its own weights, one graph; µs per layer for today's
   kernels, for `decode_gemm` at each linear's best tile, with dependent launch (norms too), and with
   1 or 2 weight tiles asked of the L2 before the wait. The step's floor: the weight bytes / 4.24 TB/s.
"""
import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import graph_ms  # noqa: E402

from megarl.kernels.decode_gemm import decode_gemm  # noqa: E402
from megarl.kernels.rms_norm import add_rms_norm_triton  # noqa: E402
from megarl.kernels.swiglu import silu_mul  # noqa: E402
from megarl.rollout.split_linear import split_k_linear, split_parts  # noqa: E402

DEV = "cuda"
H, QKV, FFN = 1536, 2048, 8960
SHAPES = {"qkv": (QKV, H, (2, 3, 4)), "proj": (H, H, (2, 3)), "fc1": (2 * FFN, H, (1,)), "fc2": (H, FFN, (2, 4, 5))}
HBM = 4.24e12


def today(name: str, x, w):
    if name == "fc1":
        return silu_mul(F.linear(x, w))
    return split_k_linear(x, w, split_parts(name, x.shape[0], x.shape[1]))


def tiles(name: str):
    for s in SHAPES[name][2]:
        for bn in (32, 64, 128):
            for st in (3, 4):
                for nw in (4, 8):
                    yield dict(splits=s, swiglu=name == "fc1", block_n=bn, block_k=64, stages=st, num_warps=nw)


def sweep(name: str, m: int) -> list[dict]:
    n, k, _ = SHAPES[name]
    copies = max(4, math.ceil(200e6 / (n * k * 2)))  # 200 MB of weights: past the 50 MB L2
    ws = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    want = today(name, x, ws[0])
    rows = [dict(linear=name, M=m, form="today", us=graph_ms([lambda w=w: today(name, x, w) for w in ws]) * 1e3)]
    print(rows[0], flush=True)
    for t in tiles(name):
        try:
            got = decode_gemm(x, ws[0], **t)
        except Exception as e:  # noqa: BLE001  (a tile the compiler refuses: shared memory, registers)
            print(f"    {name} {t}: {type(e).__name__}", flush=True)
            continue
        diff = (got.float() - want.float()).abs().max().item() if got.shape == want.shape else None
        us = graph_ms([lambda w=w, t=t: decode_gemm(x, w, **t) for w in ws]) * 1e3
        rows.append(dict(linear=name, M=m, form="decode_gemm", **t, us=us, max_diff=diff))
        print(rows[-1], flush=True)
    return rows


def best_tiles(rows) -> dict:
    out = {}
    for r in rows:
        if r["form"] == "decode_gemm" and (r["linear"] not in out or r["us"] < out[r["linear"]]["us"]):
            out[r["linear"]] = r
    return {k: {f: r[f] for f in ("splits", "swiglu", "block_n", "block_k", "stages", "num_warps")}
            for k, r in out.items()}


def chain_us(m: int, best: dict | None, pdl: bool = False, prefetch: int = 0, layers: int = 28) -> float:
    weights = [{name: torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02 for name, (n, k, _) in SHAPES.items()}
               for _ in range(layers)]
    norm_w = torch.ones(H, device=DEV, dtype=torch.bfloat16)
    h = torch.randn(m, H, device=DEV, dtype=torch.bfloat16)
    o = torch.randn(m, H, device=DEV, dtype=torch.bfloat16)  # the attention's output, a stand-in
    res = torch.randn(m, H, device=DEV, dtype=torch.bfloat16)

    def linear(name, x, w):
        if best is None:
            return today(name, x, w)
        return decode_gemm(x, w, **best[name], pdl=pdl, prefetch=prefetch)

    def step():
        x, r = h, res
        for lw in weights:
            linear("qkv", x, lw["qkv"])
            y, r = add_rms_norm_triton(linear("proj", o, lw["proj"]), r, norm_w, 1e-6, pdl=pdl)
            x, r = add_rms_norm_triton(linear("fc2", linear("fc1", y, lw["fc1"]), lw["fc2"]), r, norm_w, 1e-6, pdl=pdl)

    return graph_ms([step]) * 1e3 / layers


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="128")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = {"sweep": [], "chain": []}
    floor = sum(n * k * 2 for n, k, _ in SHAPES.values()) / HBM * 1e6
    for m in (int(r) for r in a.rows.split(",")):
        rows = [r for name in SHAPES for r in sweep(name, m)]
        out["sweep"] += rows
        best = best_tiles(rows)
        print("best", m, best, flush=True)
        for label, kw in (("today", dict(best=None)), ("decode_gemm", dict(best=best)),
                          ("+ pdl", dict(best=best, pdl=True)), ("+ pdl, prefetch 1", dict(best=best, pdl=True, prefetch=1)),
                          ("+ pdl, prefetch 2", dict(best=best, pdl=True, prefetch=2)), ("today again", dict(best=None))):
            row = dict(M=m, form=label, us_per_layer=chain_us(m, **kw), floor_us=floor)
            print(row, flush=True)
            out["chain"].append(row)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
