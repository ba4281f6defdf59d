"""Benchmark the decode-step linears (megarl.kernels.decode_linear) against cuBLAS, and sweep their tiles.

    python benchmarks/bench_gemm.py --out $OUT/gemm.json            # CUDA (H200): sweep, ~4 min
    python benchmarks/bench_gemm.py --small --out /tmp/gemm.json    # CPU smoke run (interpreter)

Shapes: the Qwen2.5-1.5B layer at TP1 (QKV 2048 x 1536 with bias, output projection 1536 x 1536,
fc1 + SwiGLU 2 x 8960 x 1536, fc2 1536 x 8960), bf16, rows M in --rows (decode batch sizes).
Each call rotates over 28 weight copies (one per layer, as the decode step reads them: nothing
stays in L2) inside one CUDA graph; per-call device ms = graph replay / 28. cuBLAS is
``F.linear`` (+ `silu_mul` for fc1, the unfused pair the engine ran). Floor = weight bytes /
4.24 TB/s. The sweep: for each (shape, M), block_n x block_k x split count at 4 warps and 4
stages, then warps x stages around the best; the chosen row is the best config, and
"default" is what `gemm_config` picks today. Short table last; everything in --out.
"""
import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # before megarl.kernels is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import HBM_BYTES_PER_S, graph_ms  # noqa: E402

from megarl.kernels.decode_linear import GemmConfig, decode_linear, decode_swiglu, gemm_config  # noqa: E402
from megarl.kernels.swiglu import silu_mul  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
LAYERS = 28
SHAPES = {  # name: (N, K, bias, swiglu)
    "qkv": (2048, 1536, True, False),
    "proj": (1536, 1536, False, False),
    "fc1_swiglu": (17920, 1536, False, True),
    "fc2": (1536, 8960, False, False),
}


def weights(n, k, bias, layers, dtype):
    ws = [torch.randn(n, k, device=DEV, dtype=dtype) * k ** -0.5 for _ in range(layers)]
    bs = [torch.randn(n, device=DEV, dtype=dtype) if bias else None for _ in range(layers)]
    return ws, bs


def calls(provider, x, ws, bs, swiglu, cfg=None):
    if provider == "cublas":
        if swiglu:
            return [lambda w=w: silu_mul(F.linear(x, w)) for w in ws]
        return [lambda w=w, b=b: F.linear(x, w, b) for w, b in zip(ws, bs)]
    if swiglu:
        return [lambda w=w: decode_swiglu(x, w, backend="triton", config=cfg) for w in ws]
    return [lambda w=w, b=b: decode_linear(x, w, b, backend="triton", config=cfg) for w, b in zip(ws, bs)]


def device_ms(fns):
    if not CUDA:
        import time
        t = time.perf_counter()
        for f in fns:
            f()
        return (time.perf_counter() - t) * 1e3 / len(fns)
    return graph_ms(fns, reps=5)


def check(x, w, b, swiglu, cfg):
    ref = silu_mul(F.linear(x, w)) if swiglu else F.linear(x, w, b)
    out = calls("triton", x, [w], [b], swiglu, cfg)[0]()
    err = (out.float() - ref.float()).abs().max().item()
    return err <= 0.05 * max(ref.float().abs().max().item(), 1e-3)


def candidates(m, stage1_best=None):
    bm = min(128, max(16, 1 << (m - 1).bit_length()))
    if stage1_best is None:
        for bn, bk, s in itertools.product((32, 64, 128), (64, 128, 256), (1, 2, 3, 4, 6, 8, 12)):
            yield GemmConfig(bm, bn, bk, s, 4, 4)
            if m >= 256 and bm == 128:
                yield GemmConfig(64, bn, bk, s, 4, 4)
    else:
        c = stage1_best
        for w, st in itertools.product((4, 8), (2, 3, 4, 5, 6)):
            yield GemmConfig(c.block_m, c.block_n, c.block_k, c.splits, w, st)


def sweep(name, m, args):
    n, k, bias, swiglu = SHAPES[name]
    if args.small:  # the interpreter: the same code paths on 1/16 of each dim
        n, k = n // 16, k // 16
    dtype = torch.bfloat16 if CUDA else torch.float32
    layers = LAYERS if CUDA else 2
    ws, bs = weights(n, k, bias, layers, dtype)
    x = torch.randn(m, k, device=DEV, dtype=dtype)
    floor_ms = n * k * x.element_size() / HBM_BYTES_PER_S * 1e3
    row = dict(shape=name, m=m, n=n, k=k, floor_ms=floor_ms, cublas_ms=device_ms(calls("cublas", x, ws, bs, swiglu)))
    results = []

    def measure(cfg):
        try:
            if not check(x, ws[0], bs[0], swiglu, cfg):
                return None
            ms = device_ms(calls("triton", x, ws, bs, swiglu, cfg))
        except Exception as e:  # noqa: BLE001  (a config that does not fit: record, go on)
            print(f"    {cfg}: {type(e).__name__}: {str(e)[:120]}")
            return None
        if ms is not None:
            results.append(dict(cfg=cfg.__dict__, ms=ms))
        return ms

    pool = list(candidates(m)) if not args.small else [GemmConfig(16, 32, 64, 2, 4, 2)]
    for cfg in pool:
        measure(cfg)
    if results and not args.small:
        best = GemmConfig(**min(results, key=lambda r: r["ms"])["cfg"])
        for cfg in candidates(m, best):
            measure(cfg)
    default = gemm_config(m, n // 2 if swiglu else n, k, torch.device(DEV))
    row["default_cfg"], row["default_ms"] = default.__dict__, measure(default)
    if results:
        top = min(results, key=lambda r: r["ms"])
        row["best_cfg"], row["best_ms"] = top["cfg"], top["ms"]
        row["best_frac_of_floor"] = floor_ms / top["ms"]
        row["speedup_vs_cublas"] = row["cublas_ms"] / top["ms"]
    row["all"] = sorted(results, key=lambda r: r["ms"])[:12]
    print(f"{name:>11} M={m:<4} floor {floor_ms * 1e3:6.1f} us  cublas {row['cublas_ms'] * 1e3:6.1f}  "
          f"default {fmt(row['default_ms'])}  best {fmt(row.get('best_ms'))} {row.get('best_cfg')}", flush=True)
    return row


# Best tiles of the sweep (H200, 2026-12-01, this script): (block_m, block_n, block_k, splits, warps, stages)
SWEPT = {
    32: dict(qkv=(32, 32, 128, 1, 4, 5), proj=(32, 32, 128, 1, 4, 5), fc1_swiglu=(32, 128, 128, 1, 8, 4),
             fc2=(32, 128, 128, 8, 4, 4)),
    128: dict(qkv=(128, 32, 128, 1, 4, 4), proj=(128, 32, 128, 2, 4, 4), fc1_swiglu=(128, 32, 64, 1, 4, 3),
              fc2=(128, 64, 128, 4, 4, 4)),
    256: dict(qkv=(64, 64, 128, 1, 4, 4), proj=(64, 64, 128, 1, 4, 4), fc1_swiglu=(128, 32, 64, 1, 8, 3),
              fc2=(128, 64, 128, 2, 4, 4)),
}


def chain(m, variant):
    """One decode step's linears and norms, 28 layers, in one CUDA graph: per-layer device us.

    variant: cublas | cublas_pdl_norm | triton | triton_pdl | triton_pdl_prefetch."""
    from megarl.kernels.rms_norm import add_rms_norm_triton

    dtype = torch.bfloat16
    torch.manual_seed(0)  # the same weights for every variant: outputs compared below
    cfgs = {k: GemmConfig(*v) for k, v in SWEPT[m].items()}
    pdl = variant.endswith("pdl") or "pdl_" in variant
    prefetch = variant.endswith("prefetch")
    layers = []
    for _ in range(LAYERS):
        layer = {name: weights(n, k, bias, 1, dtype) for name, (n, k, bias, _) in SHAPES.items()}
        layer["norm"] = torch.rand(1536, device=DEV) + 0.5
        layers.append(layer)
    x = torch.randn(m, 1536, device=DEV, dtype=dtype)

    def lin(name, inp, layer):
        (w,), (b,) = layer[name]
        if variant.startswith("cublas"):
            return silu_mul(F.linear(inp, w)) if name == "fc1_swiglu" else F.linear(inp, w, b)
        fn = decode_swiglu if name == "fc1_swiglu" else decode_linear
        extra = {} if name == "fc1_swiglu" else {"bias": b}
        return fn(inp, w, backend="triton", config=cfgs[name], pdl=pdl, prefetch=prefetch, **extra)

    def step():
        h, res = add_rms_norm_triton(x, None, layers[0]["norm"], 1e-6, pdl=pdl)
        for layer in layers:
            qkv = lin("qkv", h, layer)
            a = lin("proj", qkv[:, :1536], layer)
            h, res = add_rms_norm_triton(a, res, layer["norm"], 1e-6, pdl=pdl)
            y = lin("fc2", lin("fc1_swiglu", h, layer), layer)
            h, res = add_rms_norm_triton(y, res, layer["norm"], 1e-6, pdl=pdl)
        return h

    ms = graph_ms([step], reps=7)
    return step().float(), dict(m=m, variant=variant, us_per_layer=ms * 1e3 / LAYERS if ms else None,
                floor_us_per_layer=sum(n * k * 2 for n, k, _, _ in SHAPES.values()) / HBM_BYTES_PER_S * 1e6)


def fmt(ms):
    return f"{ms * 1e3:6.1f}" if ms else "     -"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="32,128,256,512")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--chain", action="store_true", help="the 28-layer chain per variant instead of the sweep")
    ap.add_argument("--out", default="gemm.json")
    args = ap.parse_args()
    rows_m = [int(r) for r in args.rows.split(",")] if not args.small else [5]
    if args.chain:
        return chains(rows_m, args.out)
    out = []
    for name in args.shapes.split(","):
        for m in rows_m:
            out.append(sweep(name, m, args))
            with open(args.out, "w") as f:  # after every row: a timeout keeps what was measured
                json.dump(dict(device=torch.cuda.get_device_name() if CUDA else "cpu", rows=out), f, indent=1)
    print(f"\n{'shape':>11} {'M':>4} {'floor us':>9} {'cuBLAS us':>10} {'default us':>11} {'best us':>8} {'best/floor':>10}")
    for r in out:
        print(f"{r['shape']:>11} {r['m']:>4} {r['floor_ms'] * 1e3:9.1f} {r['cublas_ms'] * 1e3:10.1f} "
              f"{fmt(r['default_ms']):>11} {fmt(r.get('best_ms')):>8} {r.get('best_frac_of_floor', 0):10.1%}")


def chains(rows_m, path):
    out = []
    for m in rows_m:
        plain = None
        for variant in ("cublas", "cublas_pdl_norm", "triton", "triton_pdl", "triton_pdl_prefetch"):
            try:
                h, row = chain(m, variant)
                if variant == "triton":
                    plain = h
                elif variant.startswith("triton") and plain is not None:
                    row["equals_triton_bitwise"] = bool(torch.equal(h, plain))
                out.append(row)
            except Exception as e:  # noqa: BLE001  (record, go on)
                out.append(dict(m=m, variant=variant, error=f"{type(e).__name__}: {str(e)[:300]}"))
            r = out[-1]
            print(f"chain M={m:<4} {variant:<20} {r.get('us_per_layer') or r.get('error')} "
                  f"{r.get('equals_triton_bitwise', '')}", flush=True)
            with open(path, "w") as f:
                json.dump(dict(device=torch.cuda.get_device_name(), chains=out), f, indent=1)
    print(f"\n{'M':>4} {'variant':>20} {'us/layer':>9} {'floor us':>9}")
    for r in out:
        us = f"{r['us_per_layer']:9.1f}" if r.get("us_per_layer") else "    error"
        print(f"{r['m']:>4} {r['variant']:>20} {us} {r.get('floor_us_per_layer', 0):9.1f}")


if __name__ == "__main__":
    main()
