"""PPO steps on random-weight checkpoints of real shapes: time per phase, tokens/s/GPU, memory.

    python benchmarks/bench_ppo.py --config yaml/qwen2.5-1.5b.yaml --shape qwen2.5-1.5b \\
        --nproc 1 --steps 4 --out ppo.json [key=value ...]

Makes the checkpoint (and, with --rm, a reward model of the same shape) with
benchmarks/make_checkpoint.py, runs launch/ppo.py under torchrun with response
lengths fixed (rollout.ignore_eos=true), samples GPU utilization with
nvidia-smi, and reports the median of every metric over the steps after the
first (warm-up).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("rollout", "reward", "old_logprobs", "ref_logprobs", "values", "advantage",
          "critic_update", "actor_update", "weight_sync")


def make_checkpoint(shape: str, out: str, layers, classifier: bool, prompt_len: int) -> None:
    if os.path.isfile(os.path.join(out, "config.json")):
        return
    cmd = [sys.executable, "benchmarks/make_checkpoint.py", "--shape", shape, "--out", out,
           "--prompt-len", str(prompt_len), "--prompts", "4096"]
    cmd += ["--layers", str(layers)] if layers else []
    cmd += ["--classifier"] if classifier else []
    subprocess.run(cmd, cwd=ROOT, check=True)


def start_smi(path: str):
    """nvidia-smi utilization samples every second into ``path`` (None without nvidia-smi)."""
    try:
        return subprocess.Popen(["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used",
                                 "--format=csv,noheader,nounits", "-l", "1"], stdout=open(path, "w"))
    except FileNotFoundError:
        return None


def utilization(path: str, since: float) -> float | None:
    """Mean GPU utilization (%) of the samples after the warm-up fraction ``since`` of the run."""
    rows = [line.split(",") for line in open(path) if line.count(",") == 2]
    rows = rows[int(len(rows) * since):]
    return statistics.mean(float(r[1]) for r in rows) if rows else None


def summarize(run_dir: str) -> dict:
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if "perf/step_seconds" in r][1:]  # drop the warm-up step
    keys = sorted({k for r in steps for k in r if k.startswith(("timing/", "perf/", "response/", "mismatch/"))})
    return {k: statistics.median(r[k] for r in steps if k in r) for k in keys} | {"steps_measured": len(steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--shape", required=True)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--rm", action="store_true", help="add a reward model of the same shape")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--work", default="/tmp/megarl_bench")
    ap.add_argument("--out", default="bench_ppo.json")
    args, overrides = ap.parse_known_args()
    ckpt = os.path.join(args.work, f"{args.shape}-{args.layers or 'full'}")
    make_checkpoint(args.shape, ckpt, args.layers, False, args.prompt_len)
    extra = [f"model.path={ckpt}", f"data.train_path={ckpt}/prompts.jsonl", "data.eval_path=null",
             f"trainer.steps={args.steps}", f"trainer.run_dir={args.work}/run", "trainer.export_hf=false",
             "trainer.save_last=false", "trainer.tensorboard=false", "rollout.ignore_eos=true"]
    if args.rm:
        make_checkpoint(args.shape, ckpt + "-rm", args.layers, True, args.prompt_len)
        extra.append(f"reward.model.path={ckpt}-rm")
    subprocess.run(["rm", "-rf", f"{args.work}/run"])
    smi_path = os.path.join(args.work, "smi.csv")
    smi = start_smi(smi_path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
           "launch/ppo.py", args.config, *extra, *overrides]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")
    code = subprocess.run(cmd, cwd=ROOT, env=env).returncode
    if smi:
        smi.terminate()
    result = {"config": args.config, "shape": args.shape, "layers": args.layers, "nproc": args.nproc,
              "overrides": overrides, "returncode": code}
    if code == 0:
        result["median"] = summarize(f"{args.work}/run")
        result["sm_utilization_pct"] = utilization(smi_path, 1 / args.steps) if smi else None
    print(json.dumps(result, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    m = result.get("median", {})
    print(f"\n{'phase':>14} {'seconds':>8}")
    for p in PHASES:
        if f"timing/{p}" in m:
            print(f"{p:>14} {m[f'timing/{p}']:>8.2f}")
    for k in ("perf/step_seconds", "perf/tokens_per_s_per_gpu", "perf/peak_memory_gb"):
        if k in m:
            print(f"{k:>28} {m[k]:>10.1f}")
    sys.exit(code)


if __name__ == "__main__":
    main()
