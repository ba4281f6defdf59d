"""The actor update alone (no rollout): packed vs padded tokens/s, MFU, peak memory with LoRA + recompute.

    python3 benchmarks/bench_train.py --case all --out-dir .        # one H200; sized for < 8 minutes
    python3 benchmarks/bench_train.py --case packing --out train_packing.json [key=value ...]
    python benchmarks/bench_train.py --case all --small --out-dir /tmp/bench_train   # CPU smoke test, seconds

Each case builds the actor through megarl's roles (``build_actor`` on a Config made from
key=value overrides and checked by ``config_checks.validate``, as launch/ppo.py does) on a
random-weight checkpoint from benchmarks/make_checkpoint.py, and times ``Policy.update``,
what the trainer's update phase calls: forward + backward of every micro-batch and one
optimizer step (distributed Adam, fp32 master weights) over the whole batch.

Workload (seeded, the same batch every step): ``--batch`` 64 sequences of a 64-token prompt
and a response of a length drawn uniformly from 64..2048, random token ids, random old
log-probs and advantages (PPO clipped loss, token-mean); token-budget micro-batches
(``actor.max_tokens_per_micro``, first-fit decreasing). One warm-up step is dropped; the
median of ``--steps`` (3) timed steps is reported, each the wall time between two
``torch.cuda.synchronize()``. tokens/s = real tokens (prompt + response, no padding) /
median step seconds.

Cases (the JSON of each also holds its workload and per-variant details):
- ``packing``: Qwen2.5-1.5B shape (28 layers, bf16), budget 16,384 tokens; the same actor
  with ``actor.packing=true`` and ``=false`` on the same micro-batches (``padded_tokens_per_s``),
  and, as a detail, padded rows of a fixed count (8 rows x <= 2,112 tokens, the budget at the
  longest length) in batch order, the padded layout without length-aware bins.
- ``mfu``: Llama-2-7B shape with 16 of its 32 layers (a full fine-tune of all 32 needs
  ~18 bytes/parameter = 121 GB before activations), packed, budget 8,192 tokens.
  MFU = F / (t * P) with t the median step seconds and
  F = 6 * N * T + sum_i 6 * L * d * len_i^2, where N = parameters that multiply
  (all but the input embedding table; a tied table counts once, as the LM head), T = real
  tokens, L = layers, d = heads * head_dim, len_i = length of sequence i: fwd + bwd causal
  attention is 12 * L * d * len^2 (QK^T and PV, 2 FLOPs per MAC, backward twice the forward)
  halved for causality. P = 989e12 (bf16 dense peak of H100/H200 SXM) and, beside it,
  790e12 (bf16 matmul measured on the H200, /work/shared/gpu/README.md).
- ``memory``: the mfu checkpoint and batch; peak ``torch.cuda.max_memory_allocated`` of one
  update after the warm-up (weights, grad buffers, master weights and Adam moments all
  allocated) for the full fine-tune vs LoRA (rank 16, all four linears) + ``actor.recompute=full``;
  ratio = LoRA peak / full peak, each counted above what was allocated before its actor was built
  (megatron keeps an earlier actor's tensors alive in the same process). With ``--case all`` the
  full fine-tune is the mfu case's run.
``--small``: the tiny checkpoint of megarl/assets (fp32), 16 sequences of 4 + 4..40 tokens,
budget 128; every case runs end to end on a CPU (no memory numbers there).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ppo import ROOT, make_checkpoint  # noqa: E402

PEAK_BF16_DENSE = 989e12  # H100 / H200 SXM bf16 dense, spec sheet
PEAK_MEASURED = 790e12  # bf16 matmul measured on the H200 (/work/shared/gpu/README.md)
TINY = os.path.join(ROOT, "megarl", "assets", "tiny", "sft")


@dataclasses.dataclass(frozen=True)
class Workload:
    """One case's model and batch."""

    shape: str  # make_checkpoint.py shape, or "tiny" (megarl/assets/tiny/sft)
    layers: int | None  # fewer layers than the shape's; None: all
    dtype: str  # model.dtype
    batch: int  # sequences per update (one optimizer step)
    prompt_len: int  # tokens before every response
    min_resp: int  # response lengths drawn uniformly from min_resp..max_resp
    max_resp: int
    max_tokens: int  # actor.max_tokens_per_micro
    fixed_rows: int  # rows per padded micro-batch in the fixed-rows baseline
    lora_rank: int = 16  # memory case
    seed: int = 0


FULL = {
    "packing": Workload("qwen2.5-1.5b", None, "bfloat16", 64, 64, 64, 2048, 16384, 8),
    "mfu": Workload("llama2-7b", 16, "bfloat16", 64, 64, 64, 2048, 8192, 4),
}
FULL["memory"] = FULL["mfu"]
SMALL = {c: Workload("tiny", None, "float32", 16, 4, 4, 40, 128, 4, lora_rank=4) for c in FULL}


# ---- workload ------------------------------------------------------------------------------

def checkpoint(w: Workload, work: str) -> str:
    if w.shape == "tiny":
        return TINY
    path = os.path.join(work, f"{w.shape}-{w.layers or 'full'}")
    make_checkpoint(w.shape, path, w.layers, False, w.prompt_len)
    return path


def make_batch(w: Workload, vocab: int, dev):
    """The update's SampleBatch: prompt + uniform response lengths, random ids, old log-probs, advantages."""
    from megarl.roles.batch import SampleBatch

    gen = torch.Generator().manual_seed(w.seed)
    lengths = w.prompt_len + torch.randint(w.min_resp, w.max_resp + 1, (w.batch,), generator=gen)  # (B,)
    width = int(lengths.max())
    pos = torch.arange(width)
    real = pos < lengths[:, None]  # (B, L)
    ids = torch.randint(8, vocab, (w.batch, width), generator=gen).masked_fill(~real, 0)
    mask = (real & (pos >= w.prompt_len)).float()  # (B, L) response tokens
    old = -4 * torch.rand(w.batch, width, generator=gen) * mask
    adv = torch.randn(w.batch, width, generator=gen) * mask
    return SampleBatch(ids.to(dev), mask.to(dev), lengths.to(dev), old_logprobs=old.to(dev), advantages=adv.to(dev))


def actor_config(path: str, w: Workload, variant: list[str], extra: list[str], world: int = 1):
    """The run config of one variant, through the CLI's parser and the config checks (``world`` ranks)."""
    from megarl.cli import load_config
    from megarl.config import Config
    from megarl.config_checks import validate

    prompts = os.path.join(path, "prompts.jsonl")
    keys = [f"model.path={path}", f"model.dtype={w.dtype}", "data.eval_path=null", "rollout.n=1",
            f"data.max_prompt_len={w.prompt_len}", f"rollout.max_new_tokens={w.max_resp}",
            f"data.batch_size={w.batch}", f"actor.mini_batch_size={w.batch}",
            f"actor.micro_batch_size={w.fixed_rows}", f"actor.max_tokens_per_micro={w.max_tokens}",
            "actor.optim.lr=1e-7", "trainer.run_dir=/tmp/megarl_bench_train"]
    keys += [f"data.train_path={prompts}"] if os.path.isfile(prompts) else []
    cfg = load_config(keys + variant + extra, Config)
    validate(cfg, world)
    return cfg


def micro_layout(batch, rows: int, max_tokens: int, packing: bool) -> dict:
    """Micro-batches of a layout and the tokens the model runs on (padding included)."""
    index = batch.micro_batch_index(rows, max_tokens)
    lengths = batch.lengths.tolist()
    padded = sum(len(i) * max(lengths[j] for j in i) for i in index)
    return {"micro_batches": len(index), "computed_tokens": sum(lengths) if packing else padded}


# ---- measurement ---------------------------------------------------------------------------

def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_updates(actor, acfg, batch, warmup: int, steps: int) -> dict:
    """Median seconds of ``Policy.update`` (one optimizer step over ``batch``); the last step's peak memory."""
    times, cuda = [], torch.cuda.is_available()
    for i in range(warmup + steps):
        if cuda and i == warmup + steps - 1:
            torch.cuda.reset_peak_memory_stats()
        sync()
        start = time.perf_counter()
        (m,) = actor.update(batch, acfg, 1.0, [torch.arange(len(batch))], norm_len=batch.width)
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    tokens = int(batch.lengths.sum())
    return {"step_seconds": times, "median_step_s": statistics.median(times),
            "tokens_per_s": tokens / statistics.median(times), "real_tokens": tokens,
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "grad_norm": m["grad_norm"], "oom_retries": m.get("oom_retries", 0.0)}


def profile_update(actor, acfg, batch, path: str) -> dict:
    """One ``Policy.update`` under torch.profiler: the top kernels by device time in ``path``, and
    kernel time against wall time (a gap means the host or a sync holds the device back)."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        actor.update(batch, acfg, 1.0, [torch.arange(len(batch))], norm_len=batch.width)
        sync()
    wall = time.perf_counter() - start
    events = prof.key_averages()
    with open(path, "w") as f:
        f.write(events.table(sort_by="self_device_time_total", row_limit=45))
        f.write("\n" + events.table(sort_by="cpu_time_total", row_limit=30))
    kernel_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return {"profiled_wall_s": wall, "kernel_s": kernel_us / 1e6, "profile": path}


def released() -> float | None:
    """Frees what the last actor left (cycles, cached blocks); GiB still allocated."""
    gc.collect()
    if not torch.cuda.is_available():
        return None
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated() / 2**30


def device():
    from megarl.distributed import device as this_device

    return this_device()


def build(cfg, groups):
    from megarl.roles.build import build_actor

    return build_actor(cfg, groups, optimizer_steps=100)


def matmul_params(module, info) -> int:
    """N of 6 N T: every parameter but the input embedding table (unless tied: then the LM head)."""
    skip_embedding = not info.tied_embeddings
    return sum(p.numel() for name, p in module.named_parameters()
               if not (skip_embedding and name.startswith("embedding.")))


def step_flops(n_params: int, info, lengths: list[int]) -> dict:
    """6 N T + sum_i 6 L d len_i^2 (the module docstring derives it)."""
    dense = 6 * n_params * sum(lengths)
    attention = sum(6 * info.num_layers * info.num_heads * info.head_dim * n * n for n in lengths)
    return {"dense_flops": dense, "attention_flops": attention, "flops": dense + attention}


# ---- cases ---------------------------------------------------------------------------------

def case_packing(args, groups, w: Workload) -> dict:
    """One actor; packed rows, padded rows of the same micro-batches, padded rows of fixed count."""
    from megarl.roles.build import run_options

    path = checkpoint(w, args.work)
    cfg = actor_config(path, w, [], args.overrides)
    actor = build(cfg, groups)
    batch = make_batch(w, actor.info.vocab_size, device())
    variants = {"packed": (True, cfg.actor), "padded": (False, cfg.actor),
                "padded_fixed_rows": (False, dataclasses.replace(cfg.actor, max_tokens_per_micro=0))}
    out = {}
    for name, (packing, acfg) in variants.items():
        actor.options = run_options(cfg, packing)  # what actor.packing=true|false builds
        out[name] = time_updates(actor, acfg, batch, args.warmup, args.steps)
        out[name] |= micro_layout(batch, acfg.micro_batch_size, acfg.max_tokens_per_micro, packing)
        if args.profile and torch.cuda.is_available():
            out[name] |= profile_update(actor, acfg, batch, os.path.join(args.out_dir, f"profile_{name}.txt"))
    packed, padded = out["packed"]["tokens_per_s"], out["padded"]["tokens_per_s"]
    return {"padded_tokens_per_s": padded, "packed_tokens_per_s": packed, "speedup": packed / padded,
            "speedup_vs_fixed_rows": packed / out["padded_fixed_rows"]["tokens_per_s"],
            "workload": workload(w, batch), "variants": out}


def full_finetune(args, groups, w: Workload) -> tuple[dict, object]:
    """(timings, info) of the packed full fine-tune of ``w`` (mfu case, memory baseline)."""
    cfg = actor_config(checkpoint(w, args.work), w, [], args.overrides)
    before = released()
    actor = build(cfg, groups)
    batch = make_batch(w, actor.info.vocab_size, device())
    result = time_updates(actor, cfg.actor, batch, args.warmup, args.steps)
    result |= {"matmul_params": matmul_params(actor.module, actor.info), "lengths": batch.lengths.tolist(),
               "allocated_before_build_gb": before,
               "workload": workload(w, batch)} | micro_layout(batch, 1, w.max_tokens, packing=True)
    return result, actor.info


def case_mfu(args, groups, w: Workload, shared: dict) -> dict:
    run, info = full_finetune(args, groups, w)
    shared["full_finetune"] = run
    flops = step_flops(run["matmul_params"], info, run["lengths"])
    achieved = flops["flops"] / run["median_step_s"]
    return {"mfu": achieved / PEAK_BF16_DENSE, "mfu_vs_measured_matmul_peak": achieved / PEAK_MEASURED,
            "tflops_per_s": achieved / 1e12, "tokens_per_s": run["tokens_per_s"], "peaks": {
                "bf16_dense": PEAK_BF16_DENSE, "measured_matmul": PEAK_MEASURED},
            "workload": run["workload"], "formula": "(6*N*T + sum_i 6*L*d*len_i^2) / (t * P)",
            "layers": info.num_layers, "run": {k: v for k, v in run.items() if k not in ("workload", "lengths")} | flops}


def case_memory(args, groups, w: Workload, shared: dict) -> dict:
    full = shared.get("full_finetune")
    if full is None:
        full = full_finetune(args, groups, w)[0]
        released()
    variant = [f"actor.lora.rank={w.lora_rank}", "actor.recompute=full"]
    cfg = actor_config(checkpoint(w, args.work), w, variant, args.overrides)
    before = released()
    actor = build(cfg, groups)
    batch = make_batch(w, actor.info.vocab_size, device())
    lora = time_updates(actor, cfg.actor, batch, args.warmup, args.steps) | {"allocated_before_build_gb": before}
    for run in (full, lora):  # what the role itself holds at its peak: megatron keeps a built model's
        # tensors alive after the role is dropped (most of the full fine-tune is still allocated when
        # the LoRA actor is built), so the raw peaks include the earlier cases
        if run["peak_memory_gb"] is not None:
            run["own_peak_gb"] = run["peak_memory_gb"] - (run["allocated_before_build_gb"] or 0.0)
    ratio = None if full["peak_memory_gb"] is None else lora["own_peak_gb"] / full["own_peak_gb"]
    drop = ("workload", "lengths")
    return {"full_finetune_peak_gb": full.get("own_peak_gb"), "lora_recompute_peak_gb": lora.get("own_peak_gb"),
            "ratio": ratio, "lora": {"rank": w.lora_rank, "targets": list(cfg.actor.lora.targets),
                                     "recompute": cfg.actor.recompute},
            "workload": full["workload"], "full_finetune": {k: v for k, v in full.items() if k not in drop},
            "lora_recompute": lora}


def workload(w: Workload, batch) -> dict:
    return dataclasses.asdict(w) | {"real_tokens": int(batch.lengths.sum()), "gpu": device_name(),
                                     "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


# ---- entry ---------------------------------------------------------------------------------

def table(case: str, r: dict) -> str:
    if case == "packing":
        v = r["variants"]
        rows = [f"{k:>18} {v[k]['tokens_per_s']:>10.0f} tok/s {v[k]['median_step_s']:>7.2f} s "
                f"{v[k]['micro_batches']:>3} micro-batches, {v[k]['computed_tokens']:>7} tokens computed" for k in v]
        return "\n".join(rows + [f"{'packed / padded':>18} {r['speedup']:.2f}x  (vs fixed rows "
                                 f"{r['speedup_vs_fixed_rows']:.2f}x)"])
    if case == "mfu":
        return (f"{r['layers']} layers: {r['tokens_per_s']:.0f} tok/s, {r['tflops_per_s']:.0f} TFLOP/s, "
                f"MFU {100 * r['mfu']:.1f}% of 989 ({100 * r['mfu_vs_measured_matmul_peak']:.1f}% of 790)")
    gb = lambda x: "n/a" if x is None else f"{x:.1f} GB"  # noqa: E731
    ratio = "n/a" if r["ratio"] is None else f"{100 * r['ratio']:.1f}%"
    return f"full fine-tune {gb(r['full_finetune_peak_gb'])}, LoRA + recompute {gb(r['lora_recompute_peak_gb'])}: {ratio}"


def run_case(case: str, args, groups, shared: dict) -> dict:
    w = (SMALL if args.small else FULL)[case]
    if case == "packing":
        return case_packing(args, groups, w)
    return (case_mfu if case == "mfu" else case_memory)(args, groups, w, shared)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=["packing", "mfu", "memory", "all"], required=True)
    ap.add_argument("--small", action="store_true", help="tiny model, CPU smoke test")
    ap.add_argument("--steps", type=int, default=3, help="timed update steps (median)")
    ap.add_argument("--warmup", type=int, default=1, help="update steps dropped first")
    ap.add_argument("--work", default="/tmp/megarl_bench", help="checkpoints are made (and kept) here")
    ap.add_argument("--out", default=None, help="JSON of a single case")
    ap.add_argument("--out-dir", default=".", help="--case all: train_<case>.json here")
    ap.add_argument("--profile", action="store_true", help="packing case: one profiled update per layout "
                    "(top kernels in <out-dir>/profile_<layout>.txt)")
    args, args.overrides = ap.parse_known_args()
    from megarl.launch_common import quiet_libraries

    quiet_libraries()
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.distributed import build_parallel_groups, init_distributed

    init_distributed()
    groups = build_parallel_groups(1, 1, 1)
    model_parallel_cuda_manual_seed(0)
    cases = ["packing", "mfu", "memory"] if args.case == "all" else [args.case]
    shared, lines = {}, []
    for case in cases:
        result = run_case(case, args, groups, shared)
        released()
        path = args.out if args.out and args.case != "all" else os.path.join(args.out_dir, f"train_{case}.json")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        lines.append(f"{case}: {path}\n{table(case, result)}")
        print(lines[-1], flush=True)
    print("\n" + "\n".join(lines))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
