"""Two-batch overlap of a B = 512 decode step, measured without the engine (issue 8, session 26).

    python3 benchmarks/bench_decode_overlap.py --out $OUT/overlap.json

28 layers of the 1.5B shape in one CUDA graph: the decode attention (`rope_paged_decode`, 384 keys
a row, pages in random order) and the layer's four linears (QKV + bias, output projection, fc1,
fc2; no norms, SwiGLU, logits or sampler), scheduled as
- one batch of 512 rows in sequence (what the engine does);
- two halves of 256 rows in sequence (the price of splitting: every weight read twice);
- two halves overlapped: one half's attention on a side stream beside the other half's linears,
  as a two-batch-overlap step would run them, with cuBLAS / cuBLASLt asked to leave 0..48 SMs
  free (``torch._C._set_sm_carveout_experimental``).
ms a step for each, and the attention and linears alone. H200, 2026-12-04: one batch 3.95 ms, the
best overlap 4.62 (RESULTS.md, session 26): not taken.
"""
import argparse
import json
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode_options import DEV, HKV, HQ, PAGE, SCALE, D, page_table  # noqa: E402
from bench_kernels import graph_ms  # noqa: E402

from megarl_kernels import paged_decode as PD  # noqa: E402
from megarl_kernels.decode_plan import decode_plan  # noqa: E402

B, KEYS, LAYERS, MAX_K, HIDDEN, FFN = 512, 384, 28, 640, 1536, 8960
WHOLE, HALVES = [slice(0, B)], [slice(0, B // 2), slice(B // 2, B)]


@dataclass
class Step:
    """One decode step's inputs: per-layer weights and K/V caches, one page table for all layers."""
    weights: list  # LAYERS x {name: (N, K) bf16}
    caches: list  # LAYERS x ((P, PAGE, HKV, D) K, V) bf16
    table: torch.Tensor  # (B, MAX_K / PAGE) int32
    lens: torch.Tensor  # (B,) int32, KEYS each
    pos: torch.Tensor  # (B,) int64
    slot: torch.Tensor  # (B,) int64
    cos: torch.Tensor  # (4096, D) bf16
    sin: torch.Tensor  # (4096, D) bf16
    qkv: torch.Tensor  # (B, HKV * (G + 2) * D) bf16 rows
    bias: torch.Tensor  # (HKV * (G + 2) * D,) bf16
    x: torch.Tensor  # (B, HIDDEN) bf16
    u: torch.Tensor  # (B, FFN) bf16


def make_step() -> Step:
    torch.manual_seed(0)
    width, qkv_n = -(-MAX_K // PAGE), (HQ + 2 * HKV) * D
    shapes = {"qkv": (qkv_n, HIDDEN), "proj": (HIDDEN, HIDDEN), "fc1": (2 * FFN, HIDDEN), "fc2": (HIDDEN, FFN)}
    bf16 = dict(device=DEV, dtype=torch.bfloat16)
    weights = [{n: torch.randn(*s, **bf16) * 0.02 for n, s in shapes.items()} for _ in range(LAYERS)]
    caches = [(torch.randn(1 + B * width, PAGE, HKV, D, **bf16), torch.randn(1 + B * width, PAGE, HKV, D, **bf16))
              for _ in range(LAYERS)]
    table = page_table(B, width, "random")
    lens = torch.full((B,), KEYS, dtype=torch.int32, device=DEV)
    pos = (lens - 1).long()
    slot = table.gather(1, (pos // PAGE)[:, None])[:, 0].long() * PAGE + pos % PAGE
    cos = torch.randn(4096, D, **bf16)
    return Step(weights, caches, table, lens, pos, slot, cos, torch.randn_like(cos), torch.randn(B, qkv_n, **bf16) * 0.3,
                torch.randn(qkv_n, **bf16) * 0.1, torch.randn(B, HIDDEN, **bf16), torch.randn(B, FFN, **bf16))


def plans(s: Step, parts) -> dict:
    return {r.start: decode_plan(s.lens[r], s.caches[0][0], MAX_K) for r in parts}


def attention(s: Step, layer: int, rows: slice, step_plans: dict):
    kc, vc = s.caches[layer]
    PD.rope_paged_decode(s.qkv[rows], s.cos, s.sin, s.pos[rows], s.slot[rows], kc, vc, s.table[rows], s.lens[rows],
                         SCALE, HQ // HKV, max_seqlen_k=MAX_K, bias=s.bias, plan=step_plans[rows.start])


def linears(s: Step, layer: int, rows: slice):
    w = s.weights[layer]
    F.linear(s.x[rows], w["proj"])
    F.linear(s.x[rows], w["fc1"])
    F.linear(s.u[rows], w["fc2"])
    F.linear(s.x[rows], w["qkv"], s.bias)


def in_sequence(s: Step, parts, with_attention: bool = True, with_linears: bool = True):
    step_plans = plans(s, parts) if with_attention else {}
    for layer in range(LAYERS):
        for r in parts:
            if with_attention:
                attention(s, layer, r, step_plans)
            if with_linears:
                linears(s, layer, r)


def overlapped(s: Step, side: torch.cuda.Stream):
    """Half A's linears beside half B's attention, then B's linears beside A's next layer's attention."""
    step_plans, (a, b) = plans(s, HALVES), HALVES
    attention(s, 0, a, step_plans)
    main = torch.cuda.current_stream()
    for layer in range(LAYERS):
        for mine, theirs, their_layer in ((a, b, layer), (b, a, layer + 1)):
            side.wait_stream(main)
            if their_layer < LAYERS:
                with torch.cuda.stream(side):
                    attention(s, their_layer, theirs, step_plans)
            linears(s, layer, mine)
            main.wait_stream(side)


def measure(fn, **row) -> dict:
    """row with the ms of one graph replay of fn, printed."""
    row["ms"] = graph_ms([fn], reps=5)
    print(row, flush=True)
    return row


def overlap_rows() -> list[dict]:
    s, side = make_step(), torch.cuda.Stream()
    rows = [measure(lambda: in_sequence(s, WHOLE, with_linears=False), schedule="attention 512"),
            measure(lambda: in_sequence(s, HALVES, with_linears=False), schedule="attention 2 x 256"),
            measure(lambda: in_sequence(s, WHOLE, with_attention=False), schedule="linears 512"),
            measure(lambda: in_sequence(s, HALVES, with_attention=False), schedule="linears 2 x 256"),
            measure(lambda: in_sequence(s, WHOLE), schedule="one batch"),
            measure(lambda: in_sequence(s, HALVES), schedule="two halves in sequence")]
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        for carveout in (0, 16, 32, 48):
            torch._C._set_sm_carveout_experimental(carveout or None)
            alone = graph_ms([lambda: in_sequence(s, HALVES, with_attention=False)], reps=5)
            rows.append(measure(lambda: overlapped(s, side), schedule="two halves overlapped", lib=lib,
                                sm_carveout=carveout, linears_alone_ms=alone))
    torch._C._set_sm_carveout_experimental(None)
    torch.backends.cuda.preferred_blas_library("cublas")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    with open(a.out, "w") as f:
        json.dump({"overlap": overlap_rows()}, f, indent=1)


if __name__ == "__main__":
    main()
