"""Benchmark megarl_kernels: one setup per op, shared by every provider (ref / torch / triton).

    python benchmarks/bench_kernels.py --out kernels.json        # CUDA, full sizes (H200: < 2 min)
    python benchmarks/bench_kernels.py --small --out /tmp/kernels.json  # CPU smoke run

Per row: median time over reps (CUDA events around each call, after warm-up;
small ops rotate over enough input copies that each call misses L2), the
per-call device time from a CUDA graph replay where the op is capturable
(launch overhead excluded), achieved bytes/s and its fraction of the H200
bandwidth floor (4.24 TB/s), and peak extra memory (max_memory_allocated
delta over one call). On CUDA a small sweep of each kernel's tuning constants
is recorded too (the evidence for the constants in kernels/). The triton
provider runs on CPU only under TRITON_INTERPRET=1.
"""
import argparse
import importlib
import json
import statistics
import time

import torch

import megarl_kernels as K

CUDA = torch.cuda.is_available()


def hbm_bytes_per_s() -> float:
    """The floors' bandwidth: 4.24 TB/s on an H200 (its measured device copy) and anywhere else;
    3.35 TB/s on an H100 (its HBM3 peak: a stricter floor than a measured copy)."""
    return 3.35e12 if CUDA and "H100" in torch.cuda.get_device_name() else 4.24e12


HBM_BYTES_PER_S = hbm_bytes_per_s()
DEV = "cuda" if CUDA else "cpu"
L2_DEFEAT_BYTES = 256 << 20  # input copies per op so one rotation is > 4x the 60 MB L2


def _sync():
    if CUDA:
        torch.cuda.synchronize()


def eager_ms(fns, reps):
    """Median ms per call, calls rotating over fns (one per input copy)."""
    fns[0]()  # warm-up: compile / autotune / allocator
    _sync()
    if not CUDA:
        times = []
        for i in range(reps):
            t = time.perf_counter()
            fns[i % len(fns)]()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)
    events = []
    for i in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fns[i % len(fns)]()
        e.record()
        events.append((s, e))
    _sync()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def graph_ms(fns, reps=7):
    """Per-call device ms from replaying one CUDA graph of a pass over fns; None if not capturable."""
    if not CUDA:
        return None
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for f in fns:
                f()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for f in fns:
                f()
        graph.replay()
        _sync()
        return eager_ms([graph.replay], reps) / len(fns)
    except Exception as e:  # noqa: BLE001  (a provider that syncs cannot be captured)
        print(f"    (no CUDA graph: {type(e).__name__})")
        _sync()
        return None


def peak_mb(fn):
    """Peak memory allocated during one call beyond what was allocated before it, MiB."""
    if not CUDA:
        return None
    _sync()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    _sync()
    del out
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def measure(op, provider, fns, nbytes, reps, graph=False):
    """One result row; fns: zero-arg callables, one per input copy."""
    row = dict(op=op, provider=provider, bytes=nbytes)
    try:
        row["ms"] = eager_ms(fns, reps)
        row["graph_ms"] = graph_ms(fns) if graph and row["ms"] < 5 else None
        row["peak_mb"] = peak_mb(fns[0])
    except Exception as e:  # noqa: BLE001  (record and go on: one failure must not lose the run)
        row["error"] = f"{type(e).__name__}: {e}"[:500]
        print(f"  {op:<26} {provider:<14} ERROR {row['error']}")
        return row
    device_ms = row["graph_ms"] or row["ms"]
    row["gb_per_s"] = nbytes / device_ms / 1e6
    row["frac_of_hbm_floor"] = row["gb_per_s"] * 1e9 / HBM_BYTES_PER_S
    g = f"{row['graph_ms']:.4f}" if row["graph_ms"] else "-"
    p = f"{row['peak_mb']:.0f}" if row["peak_mb"] is not None else "-"
    print(f"  {op:<26} {provider:<14} {row['ms']:>10.4f} {g:>10} {row['gb_per_s']:>9.1f} "
          f"{row['frac_of_hbm_floor']:>6.1%} {p:>9}")
    return row


def _providers(with_ref=True):
    names = (["ref"] if with_ref else []) + ["torch"]
    if K.triton_usable(torch.empty(0, device=DEV)):
        names.append("triton")
    return names


def _copies(bytes_per_copy):
    return max(1, min(32, -(-L2_DEFEAT_BYTES // max(bytes_per_copy, 1)))) if CUDA else 1


def bench_gae(small, reps):
    B, T = (8, 64) if small else (512, 2048)
    n = _copies(B * T * 9)
    sets = []
    for _ in range(n):
        lengths = torch.randint(T // 2, T + 1, (B,), device=DEV)
        mask = torch.arange(T, device=DEV)[None, :] < lengths[:, None]  # (B, T) bool
        sets.append((torch.randn(B, T, device=DEV), torch.randn(B, T, device=DEV), mask))
    rows = []
    for prov in _providers():
        for whiten in (False, True):
            if prov == "ref" and whiten:
                continue
            fns = [lambda s=s, p=prov, w=whiten: K.gae(*s, 0.99, 0.95, whiten=w, backend=p)
                   for s in (sets[:1] if prov == "ref" else sets)]
            nbytes = B * T * (17 + (9 if whiten else 0))  # r, v, adv, ret fp32 + bool mask (+ whiten pass)
            rows.append(measure(f"gae_{B}x{T}" + ("_whiten" if whiten else ""), prov, fns, nbytes,
                                3 if prov == "ref" else reps, graph=prov != "ref"))
    return rows


def bench_group_advantage(small, reps):
    B, T, G = (32, 64, 4) if small else (8192, 2048, 512)
    ids = torch.randperm(B, device=DEV) % G * 7919  # sparse ids, unsorted groups of B/G
    scores, mask = torch.randn(B, device=DEV), torch.rand(B, T, device=DEV) > 0.2
    rows = []
    for prov in _providers():
        fns = [lambda p=prov: K.group_advantage(scores, ids, mask, "grpo", backend=p)]
        rows.append(measure(f"group_adv_{B}x{T}", prov, fns, B * T * 5, 3 if prov == "ref" else reps,
                            graph=prov == "triton"))
    return rows


def bench_logprob(small, reps):
    N, V = (64, 1000) if small else (16384, 152064)
    logits = torch.randn(N, V, device=DEV, dtype=torch.bfloat16) * 3
    tgt = torch.randint(0, V, (N,), device=DEV)
    g_lp, g_ent = torch.randn(N, device=DEV), torch.randn(N, device=DEV)
    x = logits.requires_grad_(True)

    def fwd(p):
        with torch.no_grad():
            return K.logprob_entropy(logits, tgt, backend=p)

    def fwd_bwd(p):
        lp, ent = K.logprob_entropy(x, tgt, backend=p)
        return torch.autograd.grad([lp, ent], [x], [g_lp, g_ent])[0]

    rows = []
    for prov in _providers():
        r = 3 if prov == "ref" else reps
        rows.append(measure(f"logprob_{N}x{V}_fwd", prov, [lambda p=prov: fwd(p)], N * V * 2, r))
        rows.append(measure(f"logprob_{N}x{V}_fwd_bwd", prov, [lambda p=prov: fwd_bwd(p)], N * V * 6, r))
    return rows


def bench_qkv(small, reps):
    H, G, d, hidden = (4, 2, 16, 64) if small else (32, 8, 128, 4096)
    qkv = torch.randn((H + 2 * G) * d, hidden, device=DEV, dtype=torch.bfloat16)
    rows = []
    for prov in _providers(with_ref=False):
        rows.append(measure("qkv_split", prov, [lambda p=prov: K.qkv_split(qkv, H, G, backend=p)],
                            2 * qkv.numel() * 2, reps, graph=True))
    return rows


def _sweep(label, module, settings, run):
    """Time run() under each {constant: value} setting of a kernel module; restores the constants."""
    mod = importlib.import_module(module)
    saved = {k: getattr(mod, k) for k in settings[0]}
    out = []
    for s in settings:
        for k, v in s.items():
            setattr(mod, k, v)
        try:
            ms = run()
            out.append(dict(s, ms=ms))
            print(f"  sweep {label:<10} {s} -> {ms:.4f} ms")
        except Exception as e:  # noqa: BLE001
            out.append(dict(s, error=f"{type(e).__name__}: {e}"[:300]))
        finally:
            for k, v in saved.items():
                setattr(mod, k, v)
    return out


# GAE sweep: (BLOCK_T, TILE, NUM_WARPS); TILE // BLOCK_T rows per program, tokens per thread group
# VEC = min(16, TILE / (32 * NUM_WARPS)). The first GAE_SWEEP_WHITEN settings run with whiten=True
# too. About 3 s of compiles per setting.
GAE_SWEEP = [(2048, 2048, 4), (1024, 1024, 4), (512, 512, 4), (512, 512, 2), (2048, 2048, 8), (2048, 4096, 8),
             (1024, 2048, 4)]
GAE_SWEEP_WHITEN = 4


def gae_sweep(reps):
    """Per-call device ms of the Triton GAE (B=512, T=2048 fp32) under each GAE_SWEEP setting."""
    B, T = 512, 2048
    sets = [(torch.randn(B, T, device=DEV), torch.randn(B, T, device=DEV), torch.rand(B, T, device=DEV) > 0.1)
            for _ in range(_copies(B * T * 9))]
    keys = ("BLOCK_T", "TILE", "NUM_WARPS")
    out = []
    for whiten, settings in ((False, GAE_SWEEP), (True, GAE_SWEEP[:GAE_SWEEP_WHITEN])):
        fns = [lambda s=s, w=whiten: K.gae(*s, 0.99, 0.95, whiten=w, backend="triton") for s in sets]
        rows = _sweep("gae" + ("_whiten" if whiten else ""), "megarl_kernels.gae",
                      [dict(zip(keys, c)) for c in settings], lambda: graph_ms(fns) or eager_ms(fns, reps))
        nbytes = B * T * (26 if whiten else 17)
        for r in rows:
            r["whiten"] = whiten
            if "ms" in r:
                r["frac_of_hbm_floor"] = nbytes / (r["ms"] * 1e-3) / HBM_BYTES_PER_S
        best = min((r for r in rows if "ms" in r), key=lambda r: r["ms"], default=None)
        if best:
            print(f"  sweep gae best (whiten={whiten}): {best}")
        out += rows
    return out


def sweeps(reps):
    """Tuning evidence on the benchmark shapes (CUDA only)."""
    t0 = time.perf_counter()
    out = {"gae": gae_sweep(reps)}
    print(f"  (gae sweep {time.perf_counter() - t0:.0f} s)")
    N, V = 16384, 152064
    x = (torch.randn(N, V, device=DEV, dtype=torch.bfloat16) * 3).requires_grad_(True)
    tgt = torch.randint(0, V, (N,), device=DEV)

    def lp_step():
        lp, ent = K.logprob_entropy(x, tgt, backend="triton")
        return torch.autograd.grad([lp, ent], [x], [torch.ones_like(lp), torch.ones_like(ent)])[0]
    out["logprob_fwd_bwd"] = _sweep("logprob", "megarl_kernels.logprob",
                                    [dict(BLOCK_V=b, NUM_WARPS=w) for b, w in [(2048, 4), (4096, 8), (8192, 8),
                                                                               (8192, 16)]],
                                    lambda: eager_ms([lp_step], reps))
    del x
    return out


def _find(rows, op_prefix, provider):
    for r in rows:
        if r["op"].startswith(op_prefix) and r["provider"] == provider and "error" not in r:
            return r
    return None


def checks(rows):
    """The kernels' targets (GAE >= 100x the loop and >= 40% of the HBM floor; log-prob + entropy at most a
    quarter of the naive path's memory, no slower), evaluated; meaningful at full size on a GPU only."""
    out = {}
    ref, tri = _find(rows, "gae_", "ref"), _find(rows, "gae_", "triton")
    if ref and tri and not tri["op"].endswith("whiten"):
        out["gae_speedup_vs_loop"] = ref["ms"] / tri["ms"]
        out["gae_speedup_vs_loop>=100"] = out["gae_speedup_vs_loop"] >= 100
        out["gae_frac_of_hbm_floor>=0.4"] = tri["frac_of_hbm_floor"] >= 0.4
    for phase in ("fwd", "fwd_bwd"):
        ref, tri = (_find([r for r in rows if r["op"].endswith(phase)], "logprob_", p) for p in ("ref", "triton"))
        if ref and tri and ref["peak_mb"]:
            out[f"logprob_{phase}_peak_ratio"] = tri["peak_mb"] / ref["peak_mb"]
            out[f"logprob_{phase}_peak<=1/4_naive"] = tri["peak_mb"] <= ref["peak_mb"] / 4
            out[f"logprob_{phase}_time<=naive"] = tri["ms"] <= ref["ms"]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="kernels.json", help="JSON results path")
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--reps", type=int, default=20, help="timed calls per provider")
    ap.add_argument("--ops", default="gae,group_advantage,logprob,qkv", help="comma list")
    ap.add_argument("--no-sweep", action="store_true", help="skip the tuning sweeps (CUDA)")
    args = ap.parse_args()
    benches = dict(gae=bench_gae, group_advantage=bench_group_advantage, logprob=bench_logprob,
                   qkv=bench_qkv)
    print(f"device: {torch.cuda.get_device_name() if CUDA else 'cpu'}   reps: {args.reps}")
    print(f"  {'op':<26} {'provider':<14} {'ms':>10} {'graph_ms':>10} {'GB/s':>9} {'%HBM':>6} {'peak_MB':>9}")
    rows = []
    for name in args.ops.split(","):
        torch.manual_seed(0)
        rows += benches[name](args.small, args.reps)
        if CUDA:
            torch.cuda.empty_cache()
    result = dict(device=torch.cuda.get_device_name() if CUDA else "cpu", small=args.small,
                  torch=torch.__version__, hbm_bytes_per_s=HBM_BYTES_PER_S, results=rows, checks=checks(rows))
    if CUDA and not args.small and not args.no_sweep:
        result["sweeps"] = sweeps(max(5, args.reps // 4))
    for k, v in result["checks"].items():
        print(f"  check {k}: {v:.3g}" if isinstance(v, float) and not isinstance(v, bool) else f"  check {k}: {v}")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
