"""Does a decode-step GEMM let a programmatically dependent kernel start before it ends?

A Triton kernel launched with ``launch_pdl=True`` may start its programs once the kernel before it
triggers (``griddepcontrol.launch_dependents``) or ends, and waits at ``gdc_wait`` for that
kernel's memory. Whether the cuBLAS GEMMs of the decode step trigger early decides whether work
that does not need their output (the decode attention's plan, row and page-id loads: a chain of
dependent loads) can hide under them. Timed in CUDA graphs, us per (GEMM, chaser) pair:

  gemm      the GEMM alone               chase     the chaser alone (a chain of dependent loads)
  serial    GEMM then chaser, plain      pdl_pre   chaser with launch_pdl, its chain before gdc_wait
  pdl_post  chaser with launch_pdl, its chain after gdc_wait (the control)

pdl_pre near max(gemm, chase) means the GEMM triggers early; near serial, it does not.
Then fc1 at the same rows as F.linear and as `split_k_linear` partials (S = 2, 3, 4), weights past the L2.
GPU only: python3 benchmarks/probe_dependent_launch.py --out probe.json
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from megarl.rollout.split_linear import split_k_linear


@triton.jit
def _chase(table_ptr, out_ptr, hops, n, PRE: tl.constexpr):
    """Each program follows ``hops`` dependent loads through a random permutation, before or after gdc_wait."""
    i = (tl.program_id(0) * 7919) % n
    if not PRE:
        gdc_wait()
    for _ in range(hops):
        i = tl.load(table_ptr + i)
    if PRE:
        gdc_wait()
    tl.store(out_ptr + tl.program_id(0), i)


def gemms(rows: int, device):
    """The B = ``rows`` decode step's linears (Qwen2.5-1.5B shapes) as the step runs them."""
    w = lambda n, k: torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02  # noqa: E731
    x_h, x_f = (torch.randn(rows, k, device=device, dtype=torch.bfloat16) for k in (1536, 8960))
    qkv, proj, fc1, fc2 = w(2048, 1536), w(1536, 1536), w(17920, 1536), w(1536, 8960)
    return {"qkv split 3": lambda: split_k_linear(x_h, qkv, 3), "proj split 3": lambda: split_k_linear(x_h, proj, 3),
            "fc1": lambda: F.linear(x_h, fc1), "fc2 split 4": lambda: split_k_linear(x_f, fc2, 4)}


def time_graph(body, reps: int = 20, replays: int = 50) -> float:
    """us per body() call: ``reps`` calls captured in one graph, median replay over ``replays``."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3):
            body()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            body()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return sorted(times)[len(times) // 2]


def fc1_splits(rows: int, device, layers: int = 28) -> list[dict]:
    """us per fc1 GEMM (1.5B: 17,920 x 1,536) at ``rows`` rows, ``layers`` weight copies in one graph
    (past the L2, as the step reads them): F.linear against split-K fp32 partials (S slices of K)."""
    x = torch.randn(rows, 1536, device=device, dtype=torch.bfloat16)
    ws = [torch.randn(17920, 1536, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
    out = []
    for parts in (1, 2, 3, 4):
        body = (lambda: [F.linear(x, w) for w in ws]) if parts == 1 else (
            lambda: [split_k_linear(x, w, parts) for w in ws])
        out.append({"fc1_parts": parts, "rows": rows, "us": round(time_graph(body, reps=1) / layers, 2)})
        print(out[-1], flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--programs", type=int, default=256)
    ap.add_argument("--hops", default="4,8")
    ap.add_argument("--out", default="probe_dependent_launch.json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    n = 1 << 26  # 256 MB of int32: every hop misses the L2
    table = torch.randperm(n, device=dev, dtype=torch.int64).to(torch.int32)
    out = torch.empty(args.programs, dtype=torch.int32, device=dev)
    grid = (args.programs,)
    results = []
    for hops in map(int, args.hops.split(",")):
        chase = lambda pre, pdl: _chase[grid](table, out, hops, n, PRE=pre, launch_pdl=pdl, num_warps=4)  # noqa: E731
        t_chase = time_graph(lambda: chase(False, False))
        for name, gemm in gemms(args.rows, dev).items():
            row = {"gemm": name, "rows": args.rows, "hops": hops, "chase": t_chase, "gemm_us": time_graph(gemm)}
            row["serial"] = time_graph(lambda: (gemm(), chase(True, False)))
            row["pdl_pre"] = time_graph(lambda: (gemm(), chase(True, True)))
            row["pdl_post"] = time_graph(lambda: (gemm(), chase(False, True)))
            row = {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}
            print(row, flush=True)
            results.append(row)
    results += fc1_splits(args.rows, dev)
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
