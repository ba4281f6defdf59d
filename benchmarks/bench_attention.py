"""Benchmark paged KV-cache attention (megarl_kernels.paged_attention) at the Qwen2.5-1.5B layer shape.

    python benchmarks/bench_attention.py --out attention.json         # CUDA (H200), ~3 min with sweeps
    python benchmarks/bench_attention.py --small --out /tmp/att.json       # CPU smoke run, seconds

One layer: Hq=12, Hkv=2, D=128, bf16, page 16. Decode: B in {32, 128, 512} rows of 640 keys.
Providers, on one setup: "triton" and "torch" (the gathered fallback) read the paged cache, whose
pages are shuffled; "dense" is SDPA (enable_gqa) on K/V pre-gathered into contiguous
(B, Hkv, 640, D) tensors, the baseline a paged kernel competes with. The decode step's form,
"rope_decode" rows: `rope_cache` + paged decode (two launches) against `rope_paged_decode` (one). Each provider rotates over
enough copies (disjoint pages of one cache, or separate dense tensors) that one pass is > 4x the
L2. Per row: median eager ms (CUDA events), per-call device ms from a CUDA graph of one pass
(where capturable), bytes = K + V of live tokens + q + out, achieved TB/s (graph time when there
is one) and its fraction of 4.24 TB/s. Prefill: 16 sequences x 128 new tokens (and x 1024 at full
size), causal; dense = one causal SDPA on (16, Hq, L, D). On CUDA (not --small) the tuning
constants of kernels/megarl_kernels/decode_plan.py and paged_prefill.py are swept (the evidence for them).
The short table comes last; everything goes to --out as JSON.
"""
import argparse
import importlib
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import HBM_BYTES_PER_S, L2_DEFEAT_BYTES, eager_ms, graph_ms  # noqa: E402

from megarl_kernels.dispatch import triton_usable  # noqa: E402
from megarl_kernels.paged_attention import paged_decode_attention, paged_prefill_attention, rope_paged_decode  # noqa: E402
from megarl_kernels.rope_cache import rope_cache  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
HQ, HKV, D, PAGE = 12, 2, 128, 16  # Qwen2.5-1.5B attention, engine page size
SCALE = D ** -0.5


def _copies(nbytes):
    return max(1, min(16, -(-L2_DEFEAT_BYTES // max(nbytes, 1)))) if CUDA else 1


def paged_setup(lens_per_copy, copies, hq, hkv, d, dtype):
    """One cache with `copies` disjoint shuffled page sets; per copy (q, block_table, seq_lens)."""
    rows, width = len(lens_per_copy), -(-max(lens_per_copy) // PAGE)
    n_pages = 1 + copies * rows * width
    kc = torch.randn(n_pages, PAGE, hkv, d, device=DEV, dtype=dtype)
    vc = torch.randn_like(kc)
    perm = (torch.randperm(n_pages - 1, device=DEV) + 1).int().view(copies, rows, width)
    sl = torch.tensor(lens_per_copy, dtype=torch.int32, device=DEV)
    sets = [(torch.randn(rows, hq, d, device=DEV, dtype=dtype), perm[c].contiguous(), sl) for c in range(copies)]
    return kc, vc, sets


def dense_kv(kc, vc, table, n):
    """(B, Hkv, n, D) contiguous K and V of every row (all rows n keys)."""
    def gather(c):
        return c[table.long()].flatten(1, 2)[:, :n].transpose(1, 2).contiguous()
    return gather(kc), gather(vc)


def _row(case, provider, fns, nbytes, flops, reps, graph=True):
    row = dict(case=case, provider=provider, bytes=nbytes, flops=flops)
    try:
        row["ms"] = eager_ms(fns, reps)
        row["graph_ms"] = graph_ms(fns) if graph and CUDA else None
    except Exception as e:  # noqa: BLE001  (record and go on: one failure must not lose the run)
        row["error"] = f"{type(e).__name__}: {e}"[:400]
        print(f"  {case:<22} {provider:<8} ERROR {row['error']}")
        return row
    device_ms = row["graph_ms"] or row["ms"]
    row["tb_per_s"] = nbytes / device_ms / 1e9
    row["frac_of_hbm"] = row["tb_per_s"] * 1e12 / HBM_BYTES_PER_S
    row["tflop_per_s"] = flops / device_ms / 1e9
    g = f"{row['graph_ms']:.4f}" if row["graph_ms"] else "-"
    print(f"  {case:<22} {provider:<8} eager {row['ms']:.4f} ms  graph {g} ms  {row['tb_per_s']:.2f} TB/s "
          f"({row['frac_of_hbm']:.0%})  {row['tflop_per_s']:.1f} TFLOP/s")
    return row


def _providers():
    return ["torch"] + (["triton"] if triton_usable(torch.empty(0, device=DEV)) else [])


def decode_case(B, ctx, dtype, reps):
    """Rows for one decode shape: triton, torch (paged) and dense SDPA."""
    kv_bytes = 2 * B * ctx * HKV * D * dtype.itemsize
    nbytes = kv_bytes + 2 * B * HQ * D * dtype.itemsize
    flops = 4 * B * HQ * ctx * D
    copies = _copies(kv_bytes)
    kc, vc, sets = paged_setup([ctx] * B, copies, HQ, HKV, D, dtype)
    case, rows = f"decode_B{B}_ctx{ctx}", []
    for prov in _providers():
        fns = [lambda s=s, p=prov: paged_decode_attention(s[0], kc, vc, s[1], s[2], SCALE, backend=p) for s in sets]
        rows.append(_row(case, prov, fns, nbytes, flops, reps))
    dense = [(s[0][:, :, None], *dense_kv(kc, vc, s[1], ctx)) for s in sets]
    fns = [lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, scale=SCALE, enable_gqa=True)
           for q, k, v in dense]
    rows.append(_row(case, "dense", fns, nbytes, flops, reps))
    return rows


def rope_decode_case(B, ctx, dtype, reps):
    """The decode step's attention with its RoPE and K/V write: rope_cache + paged decode (two launches)
    against rope_paged_decode (one), on fused QKV rows whose new key is each row's last (Triton only)."""
    if "triton" not in _providers():
        return []
    kv_bytes = 2 * B * ctx * HKV * D * dtype.itemsize
    nbytes, flops, g = kv_bytes + 2 * B * HQ * D * dtype.itemsize, 4 * B * HQ * ctx * D, HQ // HKV
    kc, vc, sets = paged_setup([ctx] * B, _copies(kv_bytes), HQ, HKV, D, dtype)
    pos = torch.full((B,), ctx - 1, device=DEV)
    cos, sin = torch.randn(ctx, D, device=DEV, dtype=dtype), torch.randn(ctx, D, device=DEV, dtype=dtype)
    qkv = torch.randn(B, HKV * (g + 2) * D, device=DEV, dtype=dtype)
    slots = [s[1].long()[:, (ctx - 1) // PAGE] * PAGE + (ctx - 1) % PAGE for s in sets]

    def two(s, slot):
        q = rope_cache(qkv, cos, sin, pos, slot, kc, vc, HKV, g)
        return paged_decode_attention(q, kc, vc, s[1], s[2], SCALE, backend="triton")
    case = f"rope_decode_B{B}_ctx{ctx}"
    fused = [lambda s=s, slot=slot: rope_paged_decode(qkv, cos, sin, pos, slot, kc, vc, s[1], s[2], SCALE, g)
             for s, slot in zip(sets, slots)]
    return [_row(case, "rope+attn", [lambda s=s, slot=slot: two(s, slot) for s, slot in zip(sets, slots)],
                 nbytes, flops, reps),
            _row(case, "fused", fused, nbytes, flops, reps)]


def prefill_case(N, L, dtype, reps):
    """Rows for a fresh prefill of N sequences x L tokens: triton, torch (loop) and dense causal SDPA."""
    nbytes = 2 * N * L * (HQ + HKV) * D * dtype.itemsize  # q, out, K, V once each
    flops = 4 * N * HQ * D * L * (L + 1) // 2
    kc, vc, sets = paged_setup([L] * N, 1, HQ, HKV, D, dtype)
    _, table, sl = sets[0]
    qp = torch.randn(N * L, HQ, D, device=DEV, dtype=dtype)
    cu = torch.arange(0, N * L + 1, L, dtype=torch.int32, device=DEV)
    case, rows = f"prefill_{N}x{L}", []
    for prov in _providers():
        fns = [lambda p=prov: paged_prefill_attention(qp, kc, vc, table, cu, sl, SCALE, max_seqlen_q=L, backend=p)]
        rows.append(_row(case, prov, fns, nbytes, flops, reps, graph=prov == "triton"))
    k, v = dense_kv(kc, vc, table, L)
    qd = qp.view(N, L, HQ, D).transpose(1, 2)
    fns = [lambda: F.scaled_dot_product_attention(qd, k, v, is_causal=True, scale=SCALE, enable_gqa=True)]
    rows.append(_row(case, "dense", fns, nbytes, flops, reps))
    return rows


def sweep(module, grid, run):
    """run() -> ms under each setting of a kernel module's constants; restores them."""
    mod = importlib.import_module(module)
    keys = list(grid)
    saved = {k: getattr(mod, k) for k in keys}
    out = []
    for values in itertools.product(*grid.values()):
        setting = dict(zip(keys, values))
        mod.__dict__.update(setting)
        try:
            out.append(dict(setting, ms=run()))
        except Exception as e:  # noqa: BLE001  (a setting that does not compile or fit)
            out.append(dict(setting, error=f"{type(e).__name__}: {e}"[:200]))
        finally:
            mod.__dict__.update(saved)
        print(f"  sweep {module.rsplit('.', 1)[-1]} {out[-1]}")
    return out


def sweeps(reps):
    """Tuning evidence on the benchmark shapes (CUDA only): per-call device ms in a CUDA graph."""
    dtype, result = torch.bfloat16, {}
    for B in (32, 128, 512):
        kc, vc, sets = paged_setup([640] * B, _copies(2 * B * 640 * HKV * D * 2), HQ, HKV, D, dtype)
        fns = [lambda s=s: paged_decode_attention(s[0], kc, vc, s[1], s[2], SCALE, backend="triton") for s in sets]

        def timed():
            return graph_ms(fns) or eager_ms(fns, reps)
        result[f"decode_B{B}_tiles"] = sweep("megarl_kernels.decode_plan",
                                             dict(BLOCK_N=[32, 64, 128], NUM_WARPS=[2, 4, 8], NUM_STAGES=[1, 2, 3]),
                                             timed)
        result[f"decode_B{B}_splits"] = sweep("megarl_kernels.decode_plan",
                                              dict(PROGRAMS_PER_SM=[1, 2, 4, 8], MIN_TILES_PER_SPLIT=[1, 2, 4]), timed)
    for N, L in ((16, 128), (16, 1024)):
        kc, vc, sets = paged_setup([L] * N, 1, HQ, HKV, D, dtype)
        qp = torch.randn(N * L, HQ, D, device=DEV, dtype=dtype)
        cu = torch.arange(0, N * L + 1, L, dtype=torch.int32, device=DEV)
        fn = [lambda: paged_prefill_attention(qp, kc, vc, sets[0][1], cu, sets[0][2], SCALE, max_seqlen_q=L,
                                              backend="triton")]
        result[f"prefill_{N}x{L}"] = sweep("megarl_kernels.paged_prefill",
                                           dict(BLOCK_R=[64, 128], BLOCK_N=[32, 64, 128], NUM_WARPS=[4, 8],
                                                NUM_STAGES=[1, 2, 3]),
                                           lambda: graph_ms(fn) or eager_ms(fn, reps))
    return result


def table(rows):
    """The short summary: per case, each provider's device ms, TB/s, %HBM and time vs dense."""
    print(f"\n{'case':<22} {'provider':<8} {'ms':>9} {'TB/s':>7} {'%HBM':>6} {'TFLOP/s':>8} {'x dense':>8}")
    for case in dict.fromkeys(r["case"] for r in rows):
        mine = [r for r in rows if r["case"] == case and "error" not in r]
        dense = next((r for r in mine if r["provider"] == "dense"), None)
        for r in mine:
            ms = r["graph_ms"] or r["ms"]
            vs = f"{(dense['graph_ms'] or dense['ms']) / ms:.2f}" if dense else "-"
            print(f"{case:<22} {r['provider']:<8} {ms:>9.4f} {r['tb_per_s']:>7.2f} {r['frac_of_hbm']:>6.1%} "
                  f"{r['tflop_per_s']:>8.1f} {vs:>8}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="attention.json", help="JSON results path")
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--reps", type=int, default=30, help="timed calls per provider")
    ap.add_argument("--no-sweep", action="store_true", help="skip the tuning sweeps (CUDA)")
    ap.add_argument("--decode-only", action="store_true", help="decode cases only (no prefill)")
    args = ap.parse_args()
    torch.manual_seed(0)
    dtype = torch.bfloat16 if CUDA else torch.float32
    batches, ctx, prefills = ((2, 4), 40, [(2, 16)]) if args.small else ((32, 128, 512), 640, [(16, 128), (16, 1024)])
    reps = 3 if args.small else args.reps
    print(f"device: {torch.cuda.get_device_name() if CUDA else 'cpu'}  dtype: {dtype}  reps: {reps}")
    rows = []
    for B in batches:
        rows += decode_case(B, ctx, dtype, reps) + rope_decode_case(B, ctx, dtype, reps)
    for N, L in [] if args.decode_only else prefills:
        rows += prefill_case(N, L, dtype, reps)
    result = dict(device=torch.cuda.get_device_name() if CUDA else "cpu", small=args.small, torch=torch.__version__,
                  shape=dict(hq=HQ, hkv=HKV, d=D, page=PAGE, dtype=str(dtype)), hbm_bytes_per_s=HBM_BYTES_PER_S,
                  results=rows)
    if CUDA and not args.small and not args.no_sweep:
        result["sweeps"] = sweeps(max(5, reps // 3))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    table(rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
