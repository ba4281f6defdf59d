"""Ulysses context parallelism on long sequences: CP2 trains a sequence that CP1 cannot hold, same loss.

    python3 benchmarks/bench_long_context.py --out long_context.json        # 2 GPUs of one host
    python benchmarks/bench_long_context.py --small --out /tmp/long_context.json   # CPU smoke test (gloo)

(key=value arguments are config overrides for every run, e.g. ``actor.recompute=selective``.)

Four runs, each its own ``torchrun --nproc_per_node 2`` of this file (``--worker``), one actor update
(``Policy.update``: forward + backward of every micro-batch, one optimizer step) of 2 sequences, one
sequence per micro-batch (``actor.micro_batch_size=1``), packed:

- ``short`` at CP1 (the 2 GPUs are DP2: one sequence each) and at CP2 (every GPU holds half of each
  sequence): 2 x ``--short`` tokens. The same batch and weights, so the gradient of the batch's loss,
  compared by its norm (global over the ranks), must agree up to the reductions' order (bf16 on the
  GPU; fp32 on the CPU, where they agree to ~1e-7 relative).
- ``long`` at CP1 and at CP2: 2 x ``--long`` tokens (default 32,768). At CP1 one GPU holds a whole
  sequence's activations, at CP2 half: the peak memory of each, or the out-of-memory the back-off
  (``megarl/roles/memory.py``) gave up on after halving the budget (a single sequence cannot be split).

Model: ``--shape`` (default the Llama-2-7B shape, all 32 layers; random weights from
make_checkpoint.py with ``max_position_embeddings`` raised to ``--long``), bf16, LoRA (rank 16, all
four linears) so that the activations fill the GPU, not the optimizer: by 6.4 MB per token (34 h bytes
per layer of attention-side tensors plus the SwiGLU's 3 x ffn, bf16; 32 layers), a 32k sequence needs
~210 GB at CP1 and ~105 GB at CP2 beside 13.5 GB of weights, against 141 GB per H200. ``--small``: the
tiny checkpoint of megarl/assets (fp32, CPU, gloo), 2 x 24 and 2 x 48 tokens, no memory numbers.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ppo import ROOT  # noqa: E402
from bench_train import TINY, Workload, actor_config, build, device, make_batch, time_updates  # noqa: E402

PROMPT = 64  # tokens before each response


def workload(args, tokens: int) -> Workload:
    shape, dtype = ("tiny", "float32") if args.small else (args.shape, "bfloat16")
    prompt = 4 if args.small else PROMPT
    return Workload(shape, None, dtype, batch=2, prompt_len=prompt, min_resp=tokens - prompt, max_resp=tokens - prompt,
                    max_tokens=tokens, fixed_rows=1, lora_rank=4 if args.small else 16)


def checkpoint(args) -> str:
    if args.small:
        return TINY
    path = os.path.join(args.work, f"{args.shape}-pos{args.long}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        subprocess.run([sys.executable, "benchmarks/make_checkpoint.py", "--shape", args.shape, "--out", path,
                        "--prompt-len", str(PROMPT), "--prompts", "64", "--max-positions", str(args.long)],
                       cwd=ROOT, check=True)
    return path


# ---- one run (every rank of a torchrun) ----------------------------------------------------

def worker(args) -> None:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.launch_common import quiet_libraries
    from megarl.roles.memory import PhaseOutOfMemory

    quiet_libraries()
    init_distributed()
    groups = build_parallel_groups(1, 1, args.cp)
    model_parallel_cuda_manual_seed(0)
    w = workload(args, args.tokens)
    keys = [f"parallel.cp={args.cp}", "actor.packing=true", f"actor.lora.rank={w.lora_rank}",
            "critic.micro_batch_size=1"]  # one sequence per GPU at CP1 (DP2)
    cfg = actor_config(checkpoint(args), w, keys, args.overrides, world=torch.distributed.get_world_size())
    actor = build(cfg, groups)
    batch = make_batch(w, actor.info.vocab_size, device())
    try:
        result = time_updates(actor, cfg.actor, batch, warmup=0, steps=1)
        result["out_of_memory"] = False
    except PhaseOutOfMemory as e:
        result = {"out_of_memory": True, "error": str(e), "real_tokens": int(batch.lengths.sum())}
    if torch.cuda.is_available():
        result["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
    result |= {"cp": args.cp, "tokens_per_sequence": args.tokens}
    if torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    torch.distributed.destroy_process_group()


# ---- the four runs and their comparison ----------------------------------------------------

def launch(args, cp: int, tokens: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", os.path.abspath(__file__),
           "--worker", "--cp", str(cp), "--tokens", str(tokens), "--out", out, "--work", args.work,
           "--shape", args.shape, "--long", str(args.long)] + (["--small"] if args.small else []) + args.overrides
    done = subprocess.run(cmd, cwd=ROOT)
    if done.returncode:
        return {"cp": cp, "tokens_per_sequence": tokens, "returncode": done.returncode}
    with open(out) as f:
        return json.load(f)


def compare(short: dict) -> dict:
    a, b = short["cp1"], short["cp2"]
    if "grad_norm" not in a or "grad_norm" not in b:
        return {}
    return {"grad_norm_rel_diff": abs(a["grad_norm"] - b["grad_norm"]) / max(abs(a["grad_norm"]), 1e-30)}


def table(result: dict) -> str:
    lines = []
    for case in ("short", "long"):
        for cp in ("cp1", "cp2"):
            r = result[case][cp]
            state = ("out of memory" if r.get("out_of_memory") else f"{r.get('median_step_s', float('nan')):.2f} s"
                     if "median_step_s" in r else f"exit {r.get('returncode')}")
            mem = f"{r['peak_memory_gb']:.1f} GB" if r.get("peak_memory_gb") is not None else ""
            lines.append(f"{case:>5} {cp}: 2 x {r['tokens_per_sequence']} tokens  {state:>14}  {mem:>9}  "
                         f"grad norm {r.get('grad_norm', float('nan')):.6g}")
    lines.append(f"short CP1 vs CP2 grad norm relative difference: {result['short_check'].get('grad_norm_rel_diff')}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama2-7b", help="make_checkpoint.py shape")
    ap.add_argument("--short", type=int, default=4096, help="tokens per sequence of the equal-loss check")
    ap.add_argument("--long", type=int, default=32768, help="tokens per sequence of the memory case")
    ap.add_argument("--small", action="store_true", help="tiny model on CPU (gloo)")
    ap.add_argument("--work", default="/tmp/megarl_bench", help="checkpoints are made (and kept) here")
    ap.add_argument("--out", default="long_context.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, default=0, help=argparse.SUPPRESS)
    args, args.overrides = ap.parse_known_args()  # key=value config overrides, e.g. actor.recompute=selective
    if args.worker:
        return worker(args)
    if args.small:
        args.short, args.long = 24, 48
    checkpoint(args)  # once, before the runs
    result = {case: {f"cp{cp}": launch(args, cp, tokens) for cp in (1, 2)}
              for case, tokens in (("short", args.short), ("long", args.long))}
    result["short_check"] = compare(result["short"])
    result["workload"] = dataclasses.asdict(workload(args, args.long)) | {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(table(result))


if __name__ == "__main__":
    main()
