"""Benchmark megarl_kernels.sampling: fused Triton sampling vs torch softmax + multinomial vs argmax.

    python benchmarks/bench_sampling.py --out sampling.json           # CUDA, full sizes (H200: ~1 min)
    python benchmarks/bench_sampling.py --out sampling.json --sweep   # + BLOCK_V / NUM_WARPS / split sweep
    python benchmarks/bench_sampling.py --small --out /tmp/sampling.json   # CPU smoke run (seconds)

Shapes: B in {32, 128, 512}, V = 151936 (Qwen2), fp32 and bf16 logits. Settings:
plain (T=1), greedy (T=0), top_k=50, top_p=0.9, both. Providers, one input set each:
    triton      sample_tokens(backend="triton"): two launches, no host sync
    torch_mn    temperature, sort-based top-k / top-p mask, softmax, torch.multinomial
    argmax      logits.argmax(-1): the floor of any sampler (one read of the logits)
    torch       (CPU only) sample_tokens(backend="torch"), the CPU path
Per row: median ms over reps (CUDA events around each call after warm-up; calls
rotate over enough logits copies that each call misses the 60 MB L2), the
per-call time from a CUDA graph replay for the capturable providers, and the
bytes-read floor B * V * bytes / 4.24e12 s (H200 HBM peak). The table prints last.
"""
import argparse
import importlib
import json
import os
import sys

import torch

from megarl_kernels import triton_usable
from megarl_kernels.sampling import sample_tokens

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import HBM_BYTES_PER_S, eager_ms, graph_ms  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
L2_DEFEAT_BYTES = 256 << 20
SETTINGS = {"plain": (1.0, 0, 1.0), "greedy": (0.0, 0, 1.0), "top_k50": (1.0, 50, 1.0),
            "top_p0.9": (1.0, 0, 0.9), "top_k50_top_p0.9": (1.0, 50, 0.9)}


def torch_multinomial(logits, temperature, top_k, top_p, k: int, p: float):
    """The usual torch sampler: scale, sort-based top-k / top-p mask, softmax, multinomial."""
    s = logits.float() / torch.where(temperature > 0, temperature, 1.0)[:, None]  # (B, V)
    if k > 0 or p < 1:
        sv, si = torch.sort(s, -1, descending=True)
        drop = torch.zeros_like(sv, dtype=torch.bool)
        if k > 0:
            drop |= sv < sv[:, k - 1:k]
        if p < 1:
            probs = torch.softmax(sv.masked_fill(drop, float("-inf")), -1)
            drop |= probs.cumsum(-1) - probs >= top_p[:, None]  # mass before j already >= p
        s = s.scatter(-1, si, sv.masked_fill(drop, float("-inf")))
    return torch.multinomial(torch.softmax(s, -1), 1)[:, 0]


def _inputs(B, V, dtype, setting, copies):
    t, k, p = SETTINGS[setting]
    rows = (torch.full((B,), t, device=DEV), torch.full((B,), k, dtype=torch.int32, device=DEV),
            torch.full((B,), p, device=DEV), torch.arange(B, device=DEV) * 7919 - 2**40,
            torch.zeros(B, dtype=torch.int64, device=DEV))
    logits = [(torch.randn(B, V, device=DEV) * 2.5).to(dtype) for _ in range(copies)]
    return logits, rows, (k, p)


def _providers():
    names = ["triton"] if triton_usable(torch.empty(0, device=DEV)) else []
    return names + ["torch_mn", "argmax"] + ([] if CUDA else ["torch"])


def _fns(provider, logits, rows, kp):
    if provider == "argmax":
        return [lambda x=x: x.argmax(-1) for x in logits]
    if provider == "torch_mn":
        return [lambda x=x: torch_multinomial(x, rows[0], rows[1], rows[2], *kp) for x in logits]
    return [lambda x=x: sample_tokens(x, *rows, backend=provider) for x in logits]


def measure(B, V, dtype, setting, provider, reps):
    logits_bytes = B * V * torch.finfo(dtype).bits // 8
    copies = max(1, min(16, -(-L2_DEFEAT_BYTES // logits_bytes))) if CUDA else 1
    row = dict(B=B, V=V, dtype=str(dtype).split(".")[-1], setting=setting, provider=provider,
               floor_ms=logits_bytes / HBM_BYTES_PER_S * 1e3)
    try:
        logits, rows, kp = _inputs(B, V, dtype, setting, copies)
        fns = _fns(provider, logits, rows, kp)
        row["ms"] = eager_ms(fns, reps)
        row["graph_ms"] = graph_ms(fns) if provider in ("triton", "argmax") else None
    except Exception as e:  # noqa: BLE001  (record and go on: one failure must not lose the run)
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    finally:
        logits = rows = fns = None
        if CUDA:
            torch.cuda.empty_cache()
    best = row.get("graph_ms") or row.get("ms")
    row["frac_of_floor"] = row["floor_ms"] / best if best else None
    print(f"  {_fmt(row)}", flush=True)
    return row


def _fmt(r):
    if "error" in r:
        return f"{r['B']:>4} {r['dtype']:<8} {r['setting']:<17} {r['provider']:<9} ERROR {r['error'][:60]}"
    g = f"{r['graph_ms']:.4f}" if r.get("graph_ms") else "-"
    return (f"{r['B']:>4} {r['dtype']:<8} {r['setting']:<17} {r['provider']:<9} {r['ms']:>9.4f} {g:>9} "
            f"{r['floor_ms']:>8.4f} {r['frac_of_floor']:>6.1%}")


def _sweep(reps):
    """Tuning evidence for sampling.py's first-launch constants (the second keeps FINISH_*): graph ms per
    setting at the benchmark shapes."""
    mod = importlib.import_module("megarl_kernels.sampling")
    saved = {k: getattr(mod, k) for k in ("BLOCK_V", "NUM_WARPS", "SPLIT_CHUNKS")}
    grid = [dict(BLOCK_V=b, NUM_WARPS=w, SPLIT_CHUNKS=c) for b, w, c in [(1024, 4, 16), (2048, 4, 8), (2048, 8, 8),
                                                                       (4096, 8, 4), (4096, 16, 4), (8192, 16, 2)]]
    grid += [dict(BLOCK_V=4096, NUM_WARPS=8, SPLIT_CHUNKS=c) for c in (1, 2, 3, 5, 8, 64)]
    grid += [dict(BLOCK_V=2048, NUM_WARPS=w, SPLIT_CHUNKS=c) for w, c in ((4, 2), (4, 4), (8, 2), (8, 4))]
    out = []
    for B in (32, 128, 512):
        for setting in ("plain", "top_p0.9"):
            logits, rows, _ = _inputs(B, 151936, torch.bfloat16, setting, 4 if B == 32 else 1)
            for cfg in grid:
                for k, v in cfg.items():
                    setattr(mod, k, v)
                try:
                    fns = [lambda x=x: sample_tokens(x, *rows, backend="triton") for x in logits]
                    ms = graph_ms(fns) or eager_ms(fns, reps)
                    out.append(dict(cfg, B=B, setting=setting, ms=ms))
                    print(f"  sweep B={B} {setting:<9} {cfg} -> {ms:.4f} ms", flush=True)
                except Exception as e:  # noqa: BLE001
                    out.append(dict(cfg, B=B, setting=setting, error=f"{type(e).__name__}: {e}"[:200]))
                finally:
                    for k, v in saved.items():
                        setattr(mod, k, v)
            logits = None
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="sampling.json", help="JSON results path")
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--reps", type=int, default=30, help="timed calls per provider")
    ap.add_argument("--sweep", action="store_true", help="also sweep BLOCK_V / NUM_WARPS / SPLIT_CHUNKS (CUDA)")
    ap.add_argument("--batches", default=None, help="comma list of B (default 32,128,512; --small 4,16)")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma list of " + ", ".join(SETTINGS))
    args = ap.parse_args()
    batches, V = ((4, 16), 1000) if args.small else ((32, 128, 512), 151936)
    batches = tuple(int(b) for b in args.batches.split(",")) if args.batches else batches
    reps = min(args.reps, 3) if args.small else args.reps
    device = torch.cuda.get_device_name() if CUDA else "cpu"
    print(f"device: {device}   reps: {reps}   providers: {_providers()}")
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for B in batches:
            torch.manual_seed(0)
            for setting in args.settings.split(","):
                for prov in _providers():
                    if prov == "argmax" and setting != "plain":
                        continue
                    rows.append(measure(B, V, dtype, setting, prov, reps))
    result = dict(device=device, small=args.small, torch=torch.__version__, hbm_bytes_per_s=HBM_BYTES_PER_S,
                  results=rows)
    if args.sweep and CUDA and not args.small:
        result["sweep"] = _sweep(max(5, reps // 3))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{'B':>4} {'dtype':<8} {'setting':<17} {'provider':<9} {'ms':>9} {'graph_ms':>9} {'floor_ms':>8} "
          f"{'floor%':>6}")
    for r in rows:
        print(_fmt(r))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
