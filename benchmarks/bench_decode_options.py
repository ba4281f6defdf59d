"""Alternatives for the 1.5B decode step, each timed in a CUDA graph (issue 8): is any worth taking?

    python3 benchmarks/bench_decode_options.py --out $OUT/decode_options.json [--parts attention,gemm,sampling]

- attention: the paged decode kernel at B in {32, 128, 512} and 384 / 640 keys per row, with the
  cache token-major (the engine's (P, page, Hkv, D)) or head-major ((P, Hkv, page, D) storage seen
  through strides), at the default launch and at 1, 2, 4 programs per row (`decode_plan.py`);
  fraction of HBM = K + V bytes / time / 4.24 TB/s.
- gemm: the step's linears (QKV + bias, output projection, fc1, fc2, logits) at M in {32, 128, 512}
  under cuBLAS and cuBLASLt (``torch.backends.cuda.preferred_blas_library``), with and without bf16
  reduced-precision reductions; weights rotate over copies that defeat the L2.
- splitk: the output projection and fc2 with their add + RMSNorm, and QKV (+ bias) alone, at M in
  {32, 64, 128, 256, 512}: F.linear (cuBLAS, its own split-K reduction where it picks one) against
  ``split_k_linear``'s S fp32 partials summed inside the norm kernel, S over the divisors of K.
- step-attention: the decode step's own attention call (`rope_paged_decode` on 3 fp32 QKV split-K
  partials + bias, one `decode_plan` per step shared by 28 layers' caches, all in one graph), µs
  per layer, at (B, keys) in {(128, 384), (512, 384), (32, 640)}, uniform rows and ragged ones
  (uniform² over 16..1,016 keys, seeded), pages in random order (with ``--page-orders``, uniform
  rows again with each row's pages consecutive, in a decode loop's order, ...: `page_table`);
  max |diff| of layer 0 against the torch backend.
- fc1: fc1 after its add + RMSNorm at M in {128, 256, 512} as `F.linear` under cuBLAS and cuBLASLt, a
  one-batch `bmm` and two halves: µs, bits equal to `F.linear`'s, memsets launched.
- fc1-fused: fc1 + SwiGLU after the norm at M in {32, 64, 128}: cuBLAS + `silu_mul` against
  `fc1_silu_mul`'s one kernel asking the L2 for 0..8 K steps of weights during the norm; µs and
  the share of equal output elements.
- norm: the add + RMSNorm after the split-K output projection and fc2 at M in {32, 128, 512}, the
  norm kernel's warps 1..16; µs per linear + norm and per norm alone.
- logits: the output layer after the final norm at M in {32, 128, 512}: `F.linear` (cuBLAS, cuBLASLt) against
  vocab slices written by `torch.mm` into one output; µs, bits equal, memsets.
- sampling: the fused sampler (plain at temperature 1, and greedy; V = 151,936, bf16 logits) against
  its byte floor, and how many tokens equal the torch backend's.
Prints one line per measurement and writes them all to --out. To compare two trees in one device
call, see `gpu_ab.sh`.
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import graph_ms  # noqa: E402

from megarl_kernels import paged_decode as PD  # noqa: E402
from megarl_kernels.decode_plan import decode_launch, decode_plan  # noqa: E402
from megarl_kernels.rms_norm import add_rms_norm  # noqa: E402
from megarl_kernels.sampling import sample_tokens  # noqa: E402
from megarl.rollout.split_linear import split_k_linear  # noqa: E402

DEV = "cuda"
HQ, HKV, D, PAGE = 12, 2, 128, 16
SCALE = D ** -0.5


def attention_rows():
    rows = []
    for B in (32, 128, 512):
        for ctx in (384, 640):
            width = -(-ctx // PAGE)
            copies = max(1, min(16, -(-(256 << 20) // (2 * B * ctx * HKV * D * 2))))
            n_pages = 1 + copies * B * width
            for layout in ("token", "head"):
                if layout == "token":
                    kc = torch.randn(n_pages, PAGE, HKV, D, device=DEV, dtype=torch.bfloat16)
                    vc = torch.randn_like(kc)
                else:  # (P, Hkv, page, D) storage seen as (P, page, Hkv, D)
                    kc = torch.randn(n_pages, HKV, PAGE, D, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
                    vc = torch.randn(n_pages, HKV, PAGE, D, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
                perm = (torch.randperm(n_pages - 1, device=DEV) + 1).int().view(copies, B, width)
                sl = torch.full((B,), ctx, dtype=torch.int32, device=DEV)
                qs = [torch.randn(B, HQ, D, device=DEV, dtype=torch.bfloat16) for _ in range(copies)]
                for per_row in (None, 1, 2, 4):
                    programs = per_row and per_row * B
                    fns = [lambda q=q, t=perm[c].contiguous(), p=programs: PD.paged_decode_attention_triton(
                        q, kc, vc, t, sl, SCALE, max_seqlen_k=ctx, programs=p) for c, q in enumerate(qs)]
                    ms = graph_ms(fns)
                    kv = 2 * B * ctx * HKV * D * 2
                    row = dict(B=B, ctx=ctx, layout=layout, programs=programs or decode_launch(B, kc, ctx).target,
                               us=ms * 1e3, hbm=kv / (ms * 1e-3) / 4.24e12)
                    print(row, flush=True)
                    rows.append(row)
    return rows


def gemm_rows():
    shapes = {"qkv": (2048, 1536, True), "proj": (1536, 1536, False), "fc1": (17920, 1536, False),
              "fc2": (1536, 8960, False), "logits": (151936, 1536, False)}
    rows = []
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        for reduced in (True, False):
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = reduced
            for name, (n, k, bias) in shapes.items():
                copies = max(1, min(28, -(-(256 << 20) // (n * k * 2))))
                ws = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
                bs = [torch.randn(n, device=DEV, dtype=torch.bfloat16) if bias else None for _ in range(copies)]
                for m in (32, 128, 512):
                    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
                    fns = [lambda w=w, b=b: F.linear(x, w, b) for w, b in zip(ws, bs)]
                    try:
                        us = graph_ms(fns) * 1e3
                    except Exception as e:  # noqa: BLE001
                        us = None
                        print("ERR", lib, name, m, e)
                    floor = n * k * 2 / 4.24e12 * 1e6
                    row = dict(lib=lib, reduced=reduced, op=name, M=m, us=us, floor_us=floor)
                    print(row, flush=True)
                    rows.append(row)
    torch.backends.cuda.preferred_blas_library("cublas")
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    return rows


def splitk_rows():
    h = 1536
    shapes = {"proj": (h, 1536, (2, 3, 4, 6)), "fc2": (h, 8960, (2, 4, 5, 7)), "qkv": (2048, h, (2, 3, 4, 6))}
    rows = []
    for name, (n, k, splits) in shapes.items():
        copies = max(1, min(28, -(-(256 << 20) // (n * k * 2))))
        ws = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        bias = torch.randn(n, device=DEV, dtype=torch.bfloat16) if name == "qkv" else None
        norm_w = torch.ones(h, device=DEV, dtype=torch.bfloat16)
        for m in (32, 64, 128, 256, 512):
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            res = torch.randn(m, h, device=DEV, dtype=torch.bfloat16)

            def plain(w):
                out = F.linear(x, w, bias)
                return out if bias is not None else add_rms_norm(out, res, norm_w, 1e-6)

            def split(w, s):
                parts = split_k_linear(x, w, s)
                return parts if bias is not None else add_rms_norm(parts, res, norm_w, 1e-6)

            base = graph_ms([lambda w=w: plain(w) for w in ws]) * 1e3
            for s in (1,) + splits:
                us = graph_ms([lambda w=w, s=s: split(w, s) for w in ws]) * 1e3
                row = dict(op=name, M=m, splits=s, us=us, cublas_us=base, floor_us=n * k * 2 / 4.24e12 * 1e6)
                print(row, flush=True)
                rows.append(row)
    return rows


def fc1_forms():
    """fc1 (17,920 x 1,536) after its add + RMSNorm, as the step runs them, in forms cuBLAS may tile
    differently: at M = 512 `F.linear` picks a cooperative kernel that zeroes a workspace first (a
    memset node and ~4 us of idle a layer in the loop, RESULTS.md session 22)."""
    h, n = 1536, 17920
    ws = [torch.randn(n, h, device=DEV, dtype=torch.bfloat16) * 0.02 for _ in range(4)]
    norm_w = torch.ones(h, device=DEV, dtype=torch.bfloat16)
    forms = {("linear", "cublas"): F.linear, ("linear", "cublaslt"): F.linear,  # (form, BLAS library)
             ("bmm", "cublas"): lambda x, w: torch.bmm(x[None], w.t()[None])[0],
             ("halves", "cublas"): lambda x, w: torch.cat([F.linear(x, w[: n // 2]), F.linear(x, w[n // 2:])], 1)}
    rows = []
    for m in (128, 256, 512):
        parts = torch.randn(3, m, h, device=DEV)
        res = torch.randn(m, h, device=DEV, dtype=torch.bfloat16)
        x = add_rms_norm(parts, res, norm_w, 1e-6)[0]
        want = F.linear(x, ws[0])
        for (name, lib), form in forms.items():
            torch.backends.cuda.preferred_blas_library(lib)
            fns = [lambda w=w: form(add_rms_norm(parts, res, norm_w, 1e-6)[0], w) for w in ws * 7]
            us = graph_ms(fns) * 1e3
            row = dict(op="norm+fc1", form=name, blas=lib, M=m, us=us, equal=bool(torch.equal(form(x, ws[0]), want)),
                       memsets=memsets_in(fns[:1]))
            print(row, flush=True)
            rows.append(row)
    torch.backends.cuda.preferred_blas_library("cublas")
    return rows


def fc1_fused_rows():
    """fc1 + SwiGLU after its add + RMSNorm: cuBLAS `F.linear` then `silu_mul` against
    `fc1_silu_mul`'s one kernel at its tiles, asking the L2 for 0..8 K steps of its weights
    before it waits for the norm (`PREFETCH_STEPS`'s sweep), µs per
    norm + fc1 + SwiGLU (4 weight copies rotating) and the share of output elements equal between
    the two."""
    from megarl_kernels.fc1_swiglu import fc1_silu_mul_triton
    from megarl_kernels.swiglu import silu_mul

    h, n = 1536, 17920
    ws = [torch.randn(n, h, device=DEV, dtype=torch.bfloat16) * 0.02 for _ in range(4)]
    norm_w = torch.ones(h, device=DEV, dtype=torch.bfloat16)
    forms = {"cublas+silu_mul": lambda x, w: silu_mul(F.linear(x, w))}
    forms.update({f"fc1_silu_mul prefetch {p}": lambda x, w, p=p: fc1_silu_mul_triton(x, w, prefetch=p)
                  for p in (0, 1, 2, 4, 8)})  # K steps of weights asked of the L2 during the norm
    tiles = [(128, 0, 4, 8), (64, 16, 5, 4), (64, 16, 4, 4), (64, 16, 6, 4), (64, 8, 5, 4)]  # (BLOCK_N, TAIL, stages, warps)
    forms.update({f"fc1_silu_mul {t} prefetch 1": lambda x, w, t=t: fc1_silu_mul_triton(x, w, t, prefetch=1)
                  for t in tiles})
    rows = []
    for m in (32, 64, 128):
        parts = torch.randn(3, m, h, device=DEV)
        res = torch.randn(m, h, device=DEV, dtype=torch.bfloat16)
        x = add_rms_norm(parts, res, norm_w, 1e-6)[0]
        want = forms["cublas+silu_mul"](x, ws[0])
        for name, form in forms.items():
            try:
                got = form(x, ws[0])
            except Exception as e:  # noqa: BLE001  (a tile the compiler refuses)
                print(f"    {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            fns = [lambda w=w: form(add_rms_norm(parts, res, norm_w, 1e-6)[0], w) for w in ws * 7]
            row = dict(op="norm+fc1+swiglu", form=name, M=m, us=graph_ms(fns) * 1e3,
                       equal=(got == want).float().mean().item())
            print(row, flush=True)
            rows.append(row)
    return rows


def norm_rows():
    """The add + RMSNorm after a split-K row-parallel linear, as the step runs the pair (proj: S = 3
    partials; fc2: S = 4 at 128 rows, `split_parts`), at M in {32, 128, 512} and the norm kernel's
    warps 1..16 (default: `norm_warps`); µs per linear + norm, weights rotating past the L2, and
    per norm alone (28 in a graph on the same partials)."""
    from megarl_kernels.rms_norm import add_rms_norm_triton
    from megarl.rollout.split_linear import split_parts

    h = 1536
    norm_w = torch.ones(h, device=DEV, dtype=torch.bfloat16)
    rows = []
    for m in (32, 128, 512):
        res = torch.randn(m, h, device=DEV, dtype=torch.bfloat16)
        for name, k in (("proj", 1536), ("fc2", 8960)):
            s = split_parts(name, m, k)
            ws = [torch.randn(h, k, device=DEV, dtype=torch.bfloat16) * 0.02 for _ in range(max(4, 200 * 2 ** 20 // (h * k * 2)))]
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            lin = (lambda w: split_k_linear(x, w, s)) if s > 1 else (lambda w: F.linear(x, w))
            parts = lin(ws[0])
            for warps in (None, 1, 2, 4, 8, 16):
                pair = [lambda w=w: add_rms_norm_triton(lin(w), res, norm_w, 1e-6, num_warps=warps) for w in ws]
                alone = [lambda: add_rms_norm_triton(parts, res, norm_w, 1e-6, num_warps=warps)] * 28
                row = dict(op=f"{name}+norm", M=m, splits=s, warps=warps or "default", pair_us=graph_ms(pair) * 1e3,
                           norm_us=graph_ms(alone) * 1e3)
                print(row, flush=True)
                rows.append(row)
    return rows


def logits_forms():
    """The logits GEMM (151,936 x 1,536) after the final add + RMSNorm: `F.linear` (at M = 128 cuBLAS picks a
    cooperative 192 x 128 kernel that zeroes a workspace first: a memset and ~4 us of idle a step,
    RESULTS.md session 24) against 2 or 3 vocab slices each written by `torch.mm` straight into its
    columns of one (M, V) output (no copy), and `F.linear` under cuBLASLt: µs, bits equal, memsets."""
    h, V = 1536, 151936
    w = torch.randn(V, h, device=DEV, dtype=torch.bfloat16) * 0.05
    norm_w = torch.ones(h, device=DEV, dtype=torch.bfloat16)

    def sliced(k):
        bounds = [V * i // k // 128 * 128 for i in range(k)] + [V]

        def form(x):
            out = x.new_empty(x.shape[0], V)
            for a, b in zip(bounds, bounds[1:]):
                torch.mm(x, w[a:b].t(), out=out[:, a:b])
            return out
        return form

    forms = {("linear", "cublas"): lambda x: F.linear(x, w), ("linear", "cublaslt"): lambda x: F.linear(x, w),
             ("2 slices", "cublas"): sliced(2), ("3 slices", "cublas"): sliced(3)}
    rows = []
    for m in (32, 128, 512):
        parts = torch.randn(4, m, h, device=DEV)
        res = torch.randn(m, h, device=DEV, dtype=torch.bfloat16)
        x = add_rms_norm(parts, res, norm_w, 1e-6)[0]
        torch.backends.cuda.preferred_blas_library("cublas")
        want = F.linear(x, w)
        for (name, lib), form in forms.items():
            torch.backends.cuda.preferred_blas_library(lib)
            fns = [lambda: form(add_rms_norm(parts, res, norm_w, 1e-6)[0])] * 4
            us = graph_ms(fns) * 1e3
            row = dict(op="norm+logits", form=name, blas=lib, M=m, us=us, equal=bool(torch.equal(form(x), want)),
                       memsets=memsets_in(fns[:1]))
            print(row, flush=True)
            rows.append(row)
    torch.backends.cuda.preferred_blas_library("cublas")
    return rows


def memsets_in(fns) -> int:
    """Memsets (and memset-like fill kernels) one pass over ``fns`` launches, by torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for f in fns:
            f()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if "memset" in e.key.lower())


def sampling_rows():
    rows = []
    V = 151936
    for B in (32, 128, 512):
        xs = [torch.randn(B, V, device=DEV, dtype=torch.bfloat16) * 2 for _ in range(4)]
        k = torch.full((B,), -1, dtype=torch.int32, device=DEV)
        p = torch.ones(B, device=DEV)
        seeds, offs = torch.arange(B, device=DEV) * 7919, torch.arange(B, device=DEV) + 3
        for setting, temperature in (("plain", 1.0), ("greedy", 0.0)):
            t = torch.full((B,), temperature, device=DEV)
            us = graph_ms([lambda x=x: sample_tokens(x, t, k, p, seeds, offs) for x in xs]) * 1e3
            tokens, _ = sample_tokens(xs[0], t, k, p, seeds, offs)
            want, _ = sample_tokens(xs[0], t, k, p, seeds, offs, backend="torch")
            row = dict(B=B, setting=setting, us=us, floor_us=B * V * 2 / 4.24e12 * 1e6,
                       tokens_equal_torch=int((tokens == want).sum()))
            print(row, flush=True)
            rows.append(row)
    return rows


def page_table(B: int, width: int, order: str, prompt_pages: int = 8) -> torch.Tensor:
    """(B, width) int32 page ids 1..B*width. ``random``: a permutation; ``rows``: each row's pages
    consecutive; ``steps``: as a decode loop hands them out, each row's first ``prompt_pages``
    consecutive (its prefill), then one page per row at a time (row b's j-th decode page is
    ``B`` pages after its (j-1)-th); ``runs-N``: the same with N consecutive pages at a time."""
    if order == "random":
        return (torch.randperm(B * width, device=DEV) + 1).int().view(B, width)
    ids = torch.arange(B * width, device=DEV).view(B, width)
    if order != "rows":
        run = 1 if order == "steps" else int(order.split("-")[1])
        p = min(prompt_pages, width)
        b, j = torch.arange(B, device=DEV)[:, None], torch.arange(width, device=DEV)[None, :]
        r, i = (j - p).clamp(min=0) // run, (j - p).clamp(min=0) % run
        ids = torch.where(j < p, b * p + j, B * p + (r * B + b) * run + i)
    return (ids + 1).int()


def step_attention(B: int, lens: list[int], max_k: int, layers: int = 28, order: str = "random",
                   fill: float = 1.0) -> dict:
    """µs per layer of the decode step's attention call over ``lens`` (one plan per step, ``layers``
    caches in one graph, pages in ``order``: `page_table`, holding randn x ``fill``), and layer 0's
    max |diff| against the torch backend."""
    torch.manual_seed(0)
    g, width = HQ // HKV, -(-max_k // PAGE)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    caches = [(torch.randn(1 + B * width, PAGE, HKV, D, device=DEV, dtype=torch.bfloat16) * fill,
               torch.randn(1 + B * width, PAGE, HKV, D, device=DEV, dtype=torch.bfloat16) * fill)
              for _ in range(layers)]
    table = page_table(B, width, order)
    qkv = torch.randn(3, B, HKV * (g + 2) * D, device=DEV) * 0.3  # split-K partials, as the step passes them
    bias = torch.randn(qkv.shape[-1], device=DEV, dtype=torch.bfloat16) * 0.1
    cos = torch.randn(4096, D, device=DEV, dtype=torch.bfloat16)
    sin = torch.randn_like(cos)
    pos = (lens_t - 1).long()
    slot = table.gather(1, (pos // PAGE)[:, None])[:, 0].long() * PAGE + pos % PAGE
    outs = []

    def step():
        plan = decode_plan(lens_t, caches[0][0], max_k)
        outs[:] = [PD.rope_paged_decode(qkv, cos, sin, pos, slot, kc, vc, table, lens_t, SCALE, g, max_seqlen_k=max_k,
                                        bias=bias, plan=plan) for kc, vc in caches]

    us = graph_ms([step]) * 1e3 / layers
    ref = PD.rope_paged_decode(qkv, cos, sin, pos, slot, caches[0][0].clone(), caches[0][1].clone(), table, lens_t,
                               SCALE, g, max_seqlen_k=max_k, bias=bias, backend="torch")
    return dict(B=B, mean_keys=sum(lens) / B, max_keys=max(lens), pages=order, fill=fill, us=us,
                max_abs_diff=float((outs[0].float() - ref.float()).abs().max()))


def step_attention_rows(orders: tuple[str, ...] = (), fills: tuple[float, ...] = ()):
    """Uniform and ragged rows at B = 128, 512, 32, pages in random order; uniform rows again in each
    of ``orders`` (`page_table`; session 19 found them all within 1%) and with the caches holding
    randn x each of ``fills`` instead of randn."""
    rows, g = [], torch.Generator().manual_seed(1)
    for B, keys in ((128, 384), (512, 384), (32, 640)):
        ragged = (torch.rand(B, generator=g) ** 2 * 1000 + 16).int().tolist()
        for name, lens, max_k, order, fill in (
                ("uniform", [keys] * B, 640, "random", 1.0), ("ragged", ragged, 1024, "random", 1.0),
                *(("uniform", [keys] * B, 640, o, 1.0) for o in orders),
                *(("uniform", [keys] * B, 640, "random", f) for f in fills)):
            row = dict(rows=name, **step_attention(B, lens, max_k, order=order, fill=fill))
            print(row, flush=True)
            rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="attention,gemm,sampling")
    ap.add_argument("--page-orders", default="", help="step-attention: more page orders, e.g. rows,steps,runs-4,runs-8")
    ap.add_argument("--fills", default="", help="step-attention: caches of randn x each of these too, e.g. 0.05,0")
    a = ap.parse_args()
    orders = tuple(o for o in a.page_orders.split(",") if o)
    fills = tuple(float(f) for f in a.fills.split(",") if f)
    out = {}
    for part in a.parts.split(","):
        out[part] = {"attention": attention_rows, "gemm": gemm_rows, "sampling": sampling_rows,
                     "splitk": splitk_rows, "fc1": fc1_forms, "fc1-fused": fc1_fused_rows, "norm": norm_rows,
                     "logits": logits_forms,
                     "step-attention": lambda: step_attention_rows(orders, fills)}[part]()
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
