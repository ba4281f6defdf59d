"""Partial rollouts on a long-tailed workload: GRPO steps with rollout.partial=false (sync) and =true.

On one GPU (megarl installed, or PYTHONPATH=$PWD:$PWD/kernels)::

    python benchmarks/bench_partial.py --out benchmarks/results/partial_rollout.json

CPU smoke test (the tiny model, 4 prompts x 4 samples, lengths 2..12, 4 steps)::

    python benchmarks/bench_partial.py --tiny --out /tmp/partial_tiny.json

Workload (defaults): a random-weight Qwen2.5-1.5B-shape checkpoint from
benchmarks/make_checkpoint.py (prompts of ``--prompt-len`` words), GRPO, 16
prompts x 8 samples per step, bf16, KL loss against a frozen reference (beta
0.001), one optimizer step per step, a constant reward (so the advantages are
zero; the whole backward still runs). Response lengths are sampled log-uniformly
over ``--min-len``..``--max-len`` (64..2048: most short, a long tail): each
request's length is a function of its sampling seed alone (:class:`ForcedLengths`
lowers its ``max_new_tokens`` to it, with ``rollout.ignore_eos=true``), so both
runs see the same length for the same sample (step, prompt, sample index) and a
response resumed by partial rollouts keeps its length. The engine wrapper lives
here only: launch/ppo.py runs unchanged in a worker process with the factory's
engine wrapped.

Both runs are identical except ``rollout.partial=true rollout.partial_batches=N`` (``--partial-batches``, 2)
(N batches of groups in flight; a step trains the first 16 whole groups to
finish). Measured over the last ``--measure`` steps of ``--steps`` (partial
rollouts reach their steady state after a few steps): ``rollout_tokens_per_s`` =
response tokens of the trained batches / seconds in the rollout phase (for
partial, tokens sampled in earlier steps count in the step that trains them;
over a steady state the two balance); ``tokens_per_s`` = prompt + response
tokens of the trained batches / step seconds (``perf/tokens_per_s_per_gpu``,
mean); ``step_s`` = mean step seconds. Each run is a subprocess with
``--timeout``; the JSON is rewritten after each, and ``--modes partial --merge``
adds one run to an earlier JSON of the same workload. Extra ``key=value``
arguments go to launch/ppo.py in both runs.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_e2e import CONSTANT_REWARD, finish, run_logged  # noqa: E402
from bench_ppo import ROOT, make_checkpoint  # noqa: E402

TINY_DIR = os.path.join(ROOT, "megarl", "assets", "tiny")
DEFAULTS = dict(prompts=16, samples=8, min_len=64, max_len=2048, steps=6, measure=4, dtype="bfloat16",
                micro_tokens=16384)
TINY = dict(prompts=4, samples=4, min_len=2, max_len=12, steps=4, measure=2, dtype="float32", micro_tokens=512)
MODES = ("sync", "partial")


def mode_overrides(partial_batches: int) -> dict[str, list[str]]:
    """Each mode's launch/ppo.py overrides (``partial_batches``: batches of groups in flight)."""
    return {"sync": ["rollout.partial=false"],
            "partial": ["rollout.partial=true", f"rollout.partial_batches={partial_batches}"]}


class ForcedLengths:
    """A rollout engine whose requests end at a length drawn from their seed (log-uniform over
    [low, high], never above the request's own limit); everything else is the wrapped engine's."""

    def __init__(self, engine, low: int, high: int):
        self.engine, self.low, self.high = engine, low, high

    def target(self, seed: int) -> int:
        from megarl.rollout.engine import mix_seed

        u = mix_seed(seed, 0x5EED) / 2.0**63  # uniform in [0, 1) from the seed alone
        return min(self.high, int(self.low * math.exp(u * math.log((self.high + 1) / self.low))))

    def _forced(self, requests):
        return [replace(r, max_new_tokens=min(r.max_new_tokens, self.target(r.seed))) for r in requests]

    def generate(self, requests, params):
        return self.engine.generate(self._forced(requests), params)

    def generate_until(self, requests, params, enough):
        return self.engine.generate_until(self._forced(requests), params, enough)

    @property
    def stats(self):
        return self.engine.stats

    @stats.setter
    def stats(self, value):
        self.engine.stats = value

    def __getattr__(self, name):  # update_weights, release_memory, resume_memory, ...
        return getattr(self.engine, name)


def worker(spec_path: str, argv: list[str]) -> None:
    """launch/ppo.py in this process, its engine wrapped in :class:`ForcedLengths`."""
    import runpy

    sys.path[:0] = [ROOT, os.path.join(ROOT, "kernels")]
    import megarl.trainer.ppo as ppo

    w = json.load(open(spec_path))
    build = ppo.build_engine
    ppo.build_engine = lambda *a, **k: ForcedLengths(build(*a, **k), w["min_len"], w["max_len"])
    sys.argv = [os.path.join(ROOT, "launch", "ppo.py"), *argv]
    runpy.run_path(sys.argv[0], run_name="__main__")


def workload(args) -> dict:
    if args.measure < 1 or args.measure >= args.steps:
        sys.exit(f"--measure {args.measure} must be in [1, --steps {args.steps}): the first step is warm-up")
    if args.tiny:
        model, prompts_path, config = f"{TINY_DIR}/sft", f"{TINY_DIR}/train.jsonl", "yaml/tiny_grpo.yaml"
        max_prompt = 48  # the tiny model has 64 positions
    else:
        model = os.path.join(args.work, f"{args.shape}-{args.layers or 'full'}-p{args.prompt_len}")
        make_checkpoint(args.shape, model, args.layers, False, args.prompt_len)
        prompts_path, config, max_prompt = f"{model}/prompts.jsonl", args.config, args.prompt_len + 64
    return dict(model=model, prompts_path=prompts_path, megarl_config=config, shape="tiny" if args.tiny else args.shape,
                layers=args.layers, max_prompt_len=max_prompt, prompts_per_step=args.prompts,
                samples_per_prompt=args.samples, sequences_per_step=args.prompts * args.samples,
                min_len=args.min_len, max_len=args.max_len, lengths="log-uniform in [min_len, max_len] from each "
                "request's seed (the same in both runs)", steps=args.steps, steps_measured=args.measure,
                dtype=args.dtype, micro_tokens=args.micro_tokens, beta=0.001, reward="constant 1.0",
                partial_batches=args.partial_batches, modes=mode_overrides(args.partial_batches))


def overrides(w: dict, run_dir: str) -> list[str]:
    return [f"model.path={w['model']}", f"model.dtype={w['dtype']}", f"data.train_path={w['prompts_path']}",
            "data.eval_path=null", f"data.batch_size={w['prompts_per_step']}",
            f"data.max_prompt_len={w['max_prompt_len']}", f"rollout.n={w['samples_per_prompt']}",
            f"rollout.max_new_tokens={w['max_len']}", "rollout.temperature=1.0", "rollout.ignore_eos=true",
            f"actor.mini_batch_size={w['sequences_per_step']}",
            f"actor.micro_batch_size={min(16, w['sequences_per_step'])}",
            f"actor.max_tokens_per_micro={w['micro_tokens']}",
            "actor.ppo_epochs=1", "actor.optim.lr=1e-6", "actor.optim.warmup_steps=0",
            "actor.optim.decay=constant", f"actor.kl_loss_coef={w['beta']}", "algorithm.advantage=grpo",
            "algorithm.kl_in_reward=false", "critic.enable=false", f"reward.terms={CONSTANT_REWARD}",
            f"trainer.steps={w['steps']}", f"trainer.run_dir={run_dir}", "trainer.seed=42", "trainer.export_hf=false",
            "trainer.save_last=false", "trainer.save_every=0", "trainer.tensorboard=false", "trainer.resume=false"]


def numbers(rows: list[dict], measure: int, sequences: int) -> dict:
    """Means over the last ``measure`` step rows of metrics.jsonl."""
    last = rows[-measure:]
    response = [r["response/length_mean"] * sequences for r in last]  # trained response tokens per step
    rollout_s = [r["timing/rollout"] for r in last]
    out = dict(rollout_tokens_per_s=sum(response) / sum(rollout_s),
               tokens_per_s=statistics.mean(r["perf/tokens_per_s_per_gpu"] for r in last),
               step_s=statistics.mean(r["perf/step_seconds"] for r in last), rollout_s=statistics.mean(rollout_s),
               response_tokens_per_step=statistics.mean(response),
               step_s_all=[r["perf/step_seconds"] for r in rows], rollout_s_all=[r["timing/rollout"] for r in rows])
    for key in ("partial/age_mean", "partial/age_max", "partial/stale_token_frac", "partial/carried_over"):
        if key in last[0]:
            out[key.split("/")[1]] = statistics.mean(r[key] for r in last)
    return out


def run_mode(mode: str, w: dict, args, extra: list[str], spec_path: str, stem: str) -> dict:
    run_dir = os.path.join(args.work, f"run_{mode}")
    os.system(f"rm -rf '{run_dir}'")
    argv = [w["megarl_config"], *overrides(w, run_dir), *w["modes"][mode], *extra]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", os.path.abspath(__file__),
           "--worker", spec_path, *argv]
    log = f"{stem}.{mode}.log"
    code, wall = run_logged(cmd, log, args.timeout)
    out = {"cmd": cmd}
    path = os.path.join(run_dir, "metrics.jsonl")
    rows = [r for r in map(json.loads, open(path)) if "perf/step_seconds" in r] if os.path.isfile(path) else []
    if len(rows) > args.measure:
        out.update(numbers(rows, args.measure, w["sequences_per_step"]))
    return finish(out, code, wall, log, args.timeout)


def speedups(result: dict) -> None:
    s, p = result.get("sync", {}), result.get("partial", {})
    for key in ("rollout_tokens_per_s", "tokens_per_s"):
        if s.get(key) and p.get(key):
            p[f"{key}_speedup_vs_sync"] = p[key] / s[key]


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        return worker(sys.argv[2], sys.argv[3:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=f"defaults: {DEFAULTS}")
    ap.add_argument("--tiny", action="store_true", help=f"CPU smoke test: the tiny model, {TINY}")
    ap.add_argument("--shape", default="qwen2.5-1.5b", help="make_checkpoint.py shape")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the real shape")
    ap.add_argument("--config", default="yaml/qwen2.5-1.5b.yaml", help="megarl yaml the overrides go on")
    ap.add_argument("--prompt-len", type=int, default=64, help="words per prompt")
    ap.add_argument("--prompts", type=int, help="prompts per step")
    ap.add_argument("--samples", type=int, help="samples per prompt")
    ap.add_argument("--min-len", type=int, help="shortest response")
    ap.add_argument("--max-len", type=int, help="longest response (rollout.max_new_tokens)")
    ap.add_argument("--steps", type=int, help="steps per run")
    ap.add_argument("--measure", type=int, help="last steps averaged")
    ap.add_argument("--micro-tokens", type=int, help="actor.max_tokens_per_micro")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"])
    ap.add_argument("--modes", default="sync,partial", help="comma list of sync, partial")
    ap.add_argument("--partial-batches", type=int, default=2, help="rollout.partial_batches of the partial run")
    ap.add_argument("--merge", action="store_true", help="keep the other mode's entry of an existing --out")
    ap.add_argument("--timeout", type=float, default=270,
                    help="seconds per run (two fit in one 600 s call once the checkpoint exists)")
    ap.add_argument("--work", default="/tmp/megarl_partial")
    ap.add_argument("--out", default="partial_rollout.json")
    args, extra = ap.parse_known_args()
    modes = args.modes.split(",")
    if not modes or set(modes) - set(MODES):
        ap.error(f"--modes {args.modes}: expected a comma list of {', '.join(MODES)}")
    for key, value in (TINY if args.tiny else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    os.makedirs(args.work, exist_ok=True)
    w = workload(args)
    spec_path = os.path.join(args.work, "spec.json")
    json.dump(w, open(spec_path, "w"), indent=1)
    result = {"sync": {"skipped": True}, "partial": {"skipped": True}, "workload": dict(w, overrides=extra)}
    if args.merge and os.path.isfile(args.out):
        old = json.load(open(args.out))
        if old.get("workload") == result["workload"]:
            result.update({m: old[m] for m in MODES if m not in modes and m in old})
    stem = os.path.splitext(os.path.abspath(args.out))[0]
    for mode in modes:
        result[mode] = run_mode(mode, w, args, extra, spec_path, stem)
        speedups(result)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    for mode in MODES:
        r = result[mode]
        print(f"{mode:>8}: " + "  ".join(f"{k} {r[k]:.4g}" for k in ("rollout_tokens_per_s", "tokens_per_s", "step_s")
                                         if isinstance(r.get(k), float)) + f"  {r.get('error', '')}")
    p = result["partial"]
    if "rollout_tokens_per_s_speedup_vs_sync" in p:
        print(f"partial / sync: rollout tokens/s {p['rollout_tokens_per_s_speedup_vs_sync']:.2f}x, "
              f"step tokens/s {p['tokens_per_s_speedup_vs_sync']:.2f}x")
    print(f"wrote {args.out}")
    sys.exit(0 if all(result[m].get("returncode") == 0 for m in modes) else 1)


if __name__ == "__main__":
    main()
