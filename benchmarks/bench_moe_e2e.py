"""GRPO end to end on the Qwen3-30B-A3B shape cut to the layers one H200 trains: megarl vs TRL, and R3's metrics.

    python benchmarks/bench_moe_e2e.py --out benchmarks/results/moe_e2e.json            # one H200, ~7 min
    python benchmarks/bench_moe_e2e.py --sides '' --router-replay --out /tmp/moe_e2e_r3run.json \\
        --r3-out benchmarks/results/moe_r3.json                                          # R3 run only, ~5 min
    python benchmarks/bench_moe_e2e.py --tiny --out /tmp/moe_e2e_tiny.json              # CPU smoke run

The workload is bench_e2e.py's (16 prompts x 8 samples, ~64-token prompts, exactly 256 response
tokens, KL loss beta 0.001 against a frozen reference, one optimizer step of all 128 sequences in
micro-batches of 16, constant reward, bf16; TRL 1.16 GRPOTrainer with plain ``generate``) on a
random-weight checkpoint of ``make_checkpoint.SHAPES["qwen3-30b-a3b"]`` with ``--layers`` layers
(default 8) written by benchmarks/make_checkpoint.py. Both sides read the same checkpoint, prompts
and lengths; each runs in its own subprocess (``--timeout`` each); the JSON is bench_e2e's, with
megarl's ``peak_memory_by_phase`` (GiB, max over the steps of ``memory/<phase>_peak_gb``, of what each
phase left allocated, ``<phase>_live_gb``, and of ``actor_before_step_gb``) and
``kv_released_before_training`` (the trainer calls the engine's ``release_memory`` after every rollout;
the pages are unmapped unless the engine logged that CUDA virtual memory is unavailable).

How many layers. megarl keeps bf16 weights (2 bytes a parameter), fp32 gradients (4), fp32 master
weights (4), Adam's two fp32 moments (8) and a bf16 reference (2): 20 bytes a parameter. A layer of
this shape is 0.625 B parameters (128 experts x 3 x 2048 x 768 = 604 M, attention 21 M, router 0.26 M),
embedding + head 0.62 B: 8 layers are 5.62 B parameters, 105 GiB, leaving ~34 GiB of the H200's 139
for activations, logits and the rollout's KV cache (which the trainer gives back before training);
10 layers would be 128 GiB. TRL (bf16 weights, gradients, AdamW moments, reference: 10 bytes a
parameter) fits more; the binding side is megarl's fp32 optimizer state.
On an 80 GB GPU, ``actor.optim.cpu_offload=true parallel.distributed_optimizer=true`` (Adam's
moments and step in host memory, 12 bytes a parameter on the GPU) fits the 8 layers (update peak
~71 GiB); the R3 numbers measure forwards, which the offload does not change.

``--router-replay``: one more megarl run of ``--r3-steps`` steps with ``actor.router_replay=r3``
(the native engine records every response token's top-k experts per MoE layer; the old-log-prob
forward routes to them) and ``actor.mini_batch_size`` half the batch, so each step runs the
old-log-prob forward before any update: with the weights that generated, ``r3/agreement`` and
``mismatch/abs_mean|abs_max`` measure the replayed forward, and the probe forward without replay in
the same step ``r3/no_replay/agreement`` and ``mismatch/no_replay/abs_mean|abs_max``. Means over
the steps go to ``--r3-out`` as ``{"none": {...}, "r3": {...}}`` (routing_agreement = the fraction
of the rollout's (token, k) expert choices that the training forward's router also picks, mean over
layers). ``none_run`` beside them: ``mismatch/abs_mean|abs_max`` of the main megarl run
(``router_replay=none``), when it ran in the same call.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_e2e as e2e  # noqa: E402

DEFAULTS = dict(shape="qwen3-30b-a3b", layers=8, prompt_len=64, prompts=16, samples=8, response_len=256, micro=16,
                steps=3, dtype="bfloat16")
TINY = dict(shape="qwen3-moe-tiny", layers=None, prompt_len=8, prompts=2, samples=4, response_len=8, micro=4,
            steps=2, dtype="float32")
# the rollout's KV cache: 128 x 336 tokens x 8 layers x 16 KiB = 0.7 GiB (taking half the free memory, the default,
# would only make the release matter more); forward-only passes of 32 rows: 10k tokens of 152k-vocab logits
MEGARL_OVERRIDES = ["rollout.kv_cache_gb=4", "actor.forward_micro_batch_size=32"]
R3_WORKLOAD_KEYS = ("shape", "layers", "prompts_per_step", "samples_per_prompt", "response_tokens", "dtype", "torch",
                    "transformers")
R3_METRICS = {  # JSON name -> megarl metric, per router_replay setting (megarl/trainer/replay_metrics.py)
    "none": {"routing_agreement": "r3/no_replay/agreement", "mismatch_mean": "mismatch/no_replay/abs_mean",
             "mismatch_max": "mismatch/no_replay/abs_max"},
    "r3": {"routing_agreement": "r3/agreement", "mismatch_mean": "mismatch/abs_mean",
           "mismatch_max": "mismatch/abs_max"},
}


def step_rows(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    return [r for r in map(json.loads, open(path)) if "perf/step_seconds" in r]


def peak_memory_by_phase(rows: list[dict]) -> dict[str, float]:
    """GiB per phase, max over the steps: ``memory/<phase>_peak_gb`` (the trainer's phase timer) and
    ``memory/<phase>_live_gb`` (what the phase left allocated), the engine's ``rollout/peak_memory_gb``,
    the step's ``perf/peak_memory_gb`` and ``memory/actor_before_step_gb`` (allocated as the actor's
    optimizer steps: weights, grads, masters, Adam once made, the reference, anything the update left)."""
    keys = {k for r in rows for k in r if k.startswith("memory/") or k in (
        "rollout/peak_memory_gb", "perf/peak_memory_gb")}
    name = lambda k: k.removeprefix("memory/").removesuffix("_peak_gb").replace("/", "_")  # noqa: E731
    return {name(k): max(r[k] for r in rows if r.get(k) is not None) for k in sorted(keys)}


def run_megarl(w: dict, args, overrides: list[str], log: str, work: str) -> dict:
    """bench_e2e's megarl side with the MoE overrides, its run under ``work``; adds memory per phase."""
    side_args = argparse.Namespace(**{**vars(args), "work": work})
    os.makedirs(work, exist_ok=True)
    out = e2e.run_megarl(w, side_args, MEGARL_OVERRIDES + overrides, log)
    rows = step_rows(os.path.join(work, "megarl_run"))
    out["peak_memory_by_phase"] = peak_memory_by_phase(rows)
    with open(log, errors="replace") as f:  # the engine says so when it cannot unmap its pages (no CUDA VMM)
        out["kv_released_before_training"] = "KV cache stays allocated" not in f.read()
    out["mismatch"] = {k: statistics.mean(r[k] for r in rows) for k in ("mismatch/abs_mean", "mismatch/abs_max")
                       if rows and all(k in r for r in rows)}
    return out


def r3_result(rows: list[dict], none_run: dict) -> dict:
    """``{"none": {...}, "r3": {...}}``: each metric of :data:`R3_METRICS`, mean over the steps (None when
    megarl did not log it)."""
    def mean(key):
        vals = [r[key] for r in rows if r.get(key) is not None]
        return statistics.mean(vals) if vals else None

    out = {setting: {name: mean(key) for name, key in names.items()} for setting, names in R3_METRICS.items()}
    out["none_run"] = {"mismatch_mean": none_run.get("mismatch/abs_mean"),
                       "mismatch_max": none_run.get("mismatch/abs_max")}
    out["metrics_read"] = R3_METRICS
    out["steps"] = len(rows)
    return out


def run_r3(w: dict, args, overrides: list[str], stem: str, none_run: dict) -> dict:
    """megarl with actor.router_replay=r3 for --r3-steps steps; the R3 JSON's content (and its run's)."""
    half = max(w["sequences_per_step"] // 2, w["micro_batch"])
    r3_w = dict(w, steps=args.r3_steps)
    extra = ["actor.router_replay=r3", "actor.router_replay_probe_every=1", f"actor.mini_batch_size={half}"]
    run = run_megarl(r3_w, args, overrides + extra, stem + ".r3.log", os.path.join(args.work, "r3"))
    result = r3_result(step_rows(os.path.join(args.work, "r3", "megarl_run")), none_run)
    result["run"] = {k: v for k, v in run.items() if k in ("returncode", "error", "error_lines", "log", "wall_s",
                                                         "peak_memory_by_phase")}
    result["workload"] = {"mini_batch_size": half, "steps": args.r3_steps, "overrides": overrides + extra,
                          **{k: w[k] for k in R3_WORKLOAD_KEYS if k in w}, "gpu": gpu_name(),
                          "command": shlex.join(["python", *sys.argv])}
    return result


def gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def parse() -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=f"defaults: {DEFAULTS}")
    ap.add_argument("--tiny", action="store_true", help=f"CPU smoke run: {TINY}")
    ap.add_argument("--layers", type=int, help="layers of the shape (default 8: see the memory arithmetic above)")
    ap.add_argument("--config", default="yaml/qwen2.5-1.5b.yaml", help="megarl yaml the overrides go on")
    for key in ("prompt_len", "prompts", "samples", "response_len", "micro", "steps"):
        ap.add_argument("--" + key.replace("_", "-"), type=int, dest=key)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--beta", type=float, default=0.001, help="KL loss coefficient")
    ap.add_argument("--sides", default="megarl,trl", help="comma list of megarl, trl (empty: neither)")
    ap.add_argument("--router-replay", action="store_true", help="also the R3 run, its JSON at --r3-out")
    ap.add_argument("--r3-steps", type=int, default=2)
    ap.add_argument("--r3-out", default="benchmarks/results/moe_r3.json")
    ap.add_argument("--trl-gradient-checkpointing", action="store_true", help="GRPOConfig's own default")
    ap.add_argument("--timeout", type=float, default=220, help="seconds per side (and of the R3 run)")
    ap.add_argument("--work", default="/tmp/megarl_moe_e2e")
    ap.add_argument("--out", default="benchmarks/results/moe_e2e.json")
    args, overrides = ap.parse_known_args()
    for key, value in (TINY if args.tiny else DEFAULTS).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.trl_param_dtype = None
    sides = [s for s in args.sides.split(",") if s]
    if set(sides) - {"megarl", "trl"}:
        ap.error(f"--sides {args.sides}: expected a comma list of megarl, trl")
    args.sides = sides
    return args, overrides


def main() -> None:
    args, overrides = parse()
    os.makedirs(args.work, exist_ok=True)
    w = e2e.workload(argparse.Namespace(**{**vars(args), "tiny": False}))  # checkpoint of --shape / --layers
    w["layers"] = args.layers or "all"
    w["router_aux_loss_coef"] = 0.0  # both sides: megarl's actor.moe_aux_loss_coef default; TRL would take the
    # config's 0.001 and add the load-balancing loss
    stem = os.path.splitext(os.path.abspath(args.out))[0]
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    runners = {"megarl": lambda: run_megarl(w, args, overrides, stem + ".megarl.log", args.work),
               "trl": lambda: e2e.run_trl(w, args, stem + ".trl.log")}
    result = {"megarl": {"skipped": True}, "trl": {"skipped": True},
              "workload": dict(w, megarl_overrides=MEGARL_OVERRIDES + overrides)}
    for side in [None, *args.sides]:  # the JSON is rewritten after each side, so a run cut short keeps what finished
        if side is not None:
            result[side] = runners[side]()
        if result["megarl"].get("tokens_per_s") and result["trl"].get("tokens_per_s"):
            result["megarl"]["speedup_vs_trl"] = result["megarl"]["tokens_per_s"] / result["trl"]["tokens_per_s"]
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    codes = [result[s].get("returncode") for s in args.sides]
    if args.router_replay:
        r3 = run_r3(w, args, overrides, stem, result["megarl"].get("mismatch", {}))
        with open(args.r3_out, "w") as f:
            json.dump(r3, f, indent=1)
        codes.append(r3["run"].get("returncode"))
        print(f"wrote {args.r3_out}: " + json.dumps({k: r3[k] for k in ("none", "r3", "none_run")}))
    print(f"\nwrote {args.out}\n" + e2e.table(result))
    sys.exit(0 if all(c == 0 for c in codes) else 1)


if __name__ == "__main__":
    main()
