"""GRPO end to end, megarl vs TRL's GRPOTrainer: one workload, one process tree, one JSON.

On one GPU, with megarl and TRL installed (``pip install -e ".[bench]"``: trl 1.16, the version
measured, with datasets 4.x and accelerate)::

    python benchmarks/bench_e2e.py --out e2e.json       # ~5 minutes; logs e2e.megarl.log, e2e.trl.log

CPU smoke test (tiny model, 2 prompts x 4 samples, 8 tokens, fp32, 2 steps)::

    python benchmarks/bench_e2e.py --tiny --out /tmp/e2e_tiny.json

The cost of rollout correction: ``--sides megarl,megarl_rc`` runs megarl twice, the second with
``RC_OVERRIDES`` (icepop, the mode with the most terms: ratio, band mask and weights), and writes
``rollout_correction_cost_pct`` = 100 * (rc - plain) / plain of the median ``timing/actor_update``
(the update phase, where the correction is computed) into the JSON, and ``rollout_correction_terms``: the
terms alone timed on the run's shapes (benchmarks/rc_terms.py), without the two runs' step-to-step spread.

Workload (defaults): a random-weight Qwen2.5-1.5B-shape checkpoint from
benchmarks/make_checkpoint.py (tokenizer with a chat template, prompts of
``--prompt-len`` words), 16 prompts x 8 samples = 128 sequences per step, every
response exactly 256 tokens (megarl ``rollout.ignore_eos=true``; TRL
``generation_kwargs={"min_new_tokens": 256}``, which masks eos until then),
temperature 1, bf16, KL loss against a frozen reference (beta 0.001), one
optimizer step of all 128 sequences per step (micro-batches of 16), lr 1e-6
constant, a constant reward of 1 for every sample (megarl: the ``format`` rule
with pattern ``^``; TRL: a function returning 1.0), so reward speed is not
measured and the GRPO advantages are zero on both sides (the KL term and the
whole backward still run). TRL generates with plain ``transformers``
``generate`` (``use_vllm=False``), keeps its parameters in ``--dtype`` under bf16
autocast (pure-bf16 AdamW; megarl keeps fp32 main params, so this favours TRL),
and runs without gradient checkpointing unless ``--trl-gradient-checkpointing``
(GRPOConfig's default is on; megarl does not recompute).

Measured: seconds per step, median over the steps after the first (warm-up);
tokens/s = prompt + response tokens of the step (every sequence's templated
prompt, counted once per sample, plus its response; no padding) / step seconds,
median over the same steps; megarl's rollout seconds (``timing/rollout``); TRL's
``model.generate`` seconds (a synchronizing wrapper). Each side runs in its own
subprocess with ``--timeout``; a side that fails still leaves the other's
numbers, and its log tail in the JSON. Logs go beside ``--out``. Extra
``key=value`` arguments go to megarl's launch/ppo.py.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ppo import ROOT, make_checkpoint, summarize  # noqa: E402
from rc_terms import correction_terms  # noqa: E402

TINY_DIR = os.path.join(ROOT, "megarl", "assets", "tiny")
DEFAULTS = dict(prompts=16, samples=8, response_len=256, micro=16, steps=4, dtype="bfloat16")
TINY = dict(prompts=2, samples=4, response_len=8, micro=4, steps=2, dtype="float32")  # with --tiny
RC_OVERRIDES = ["algorithm.rollout_correction.preset=async"]  # the megarl_rc side: icepop in [0.5, 2]
CONSTANT_REWARD = "[{name: format, weight: 1.0, kwargs: {pattern: '^'}}]"  # re.search('^', s) always matches
TOKENS_COUNTED = ("prompt + response tokens of every sequence of the step (templated prompt counted once per "
                  "sample, no padding) divided by the step's wall seconds")


def constant_reward(prompts, completions, **kwargs) -> list[float]:
    """TRL reward function: 1.0 for every completion (megarl's format term with pattern '^')."""
    return [1.0] * len(completions)


def workload(args) -> dict:
    """The one description of the run both sides read."""
    if args.steps < 2:
        sys.exit("--steps must be at least 2: the first step is warm-up and dropped")
    if (args.prompts * args.samples) % args.micro:
        sys.exit(f"--micro {args.micro} must divide --prompts x --samples = {args.prompts * args.samples}")
    if args.tiny:
        model, prompts_path, config = f"{TINY_DIR}/sft", f"{TINY_DIR}/train.jsonl", "yaml/tiny_grpo.yaml"
        max_prompt = 48  # the tiny model has 64 positions
    else:
        model = os.path.join(args.work, f"{args.shape}-{args.layers or 'full'}-p{args.prompt_len}")
        make_checkpoint(args.shape, model, args.layers, False, args.prompt_len)
        prompts_path, config, max_prompt = f"{model}/prompts.jsonl", args.config, args.prompt_len + 64
    import torch
    import transformers

    return dict(model=model, tokenizer=model, prompts_path=prompts_path, megarl_config=config,
                shape="tiny" if args.tiny else args.shape, layers=args.layers, max_prompt_len=max_prompt,
                prompts_per_step=args.prompts, samples_per_prompt=args.samples,
                sequences_per_step=args.prompts * args.samples, response_tokens=args.response_len,
                micro_batch=args.micro, grad_accum=args.prompts * args.samples // args.micro,
                optimizer_steps_per_step=1, steps=args.steps, warmup_steps_dropped=1, lr=args.lr,
                lr_schedule="constant", clip_grad=1.0, beta=args.beta, kl_estimator="k3 (low_var_kl)",
                temperature=1.0, dtype=args.dtype, trl_param_dtype=args.trl_param_dtype or args.dtype,
                trl_gradient_checkpointing=args.trl_gradient_checkpointing, trl_use_vllm=False,
                device="cuda" if torch.cuda.is_available() else "cpu", seed=42,
                reward="constant 1.0 (megarl: format with pattern '^'; TRL: a function)",
                tokens_counted=TOKENS_COUNTED, torch=torch.__version__, transformers=transformers.__version__)


def megarl_overrides(w: dict, run_dir: str) -> list[str]:
    return [f"model.path={w['model']}", f"model.dtype={w['dtype']}", f"data.train_path={w['prompts_path']}",
            "data.eval_path=null", f"data.batch_size={w['prompts_per_step']}",
            f"data.max_prompt_len={w['max_prompt_len']}", f"rollout.n={w['samples_per_prompt']}",
            f"rollout.max_new_tokens={w['response_tokens']}", f"rollout.temperature={w['temperature']}",
            "rollout.ignore_eos=true", f"actor.mini_batch_size={w['sequences_per_step']}",
            f"actor.micro_batch_size={w['micro_batch']}", f"critic.micro_batch_size={w['micro_batch']}",
            "actor.ppo_epochs=1", f"actor.optim.lr={w['lr']}",
            "actor.optim.warmup_steps=0", "actor.optim.decay=constant", f"actor.optim.clip_grad={w['clip_grad']}",
            f"actor.kl_loss_coef={w['beta']}", "actor.kl_loss_estimator=low_var_kl", "algorithm.advantage=grpo",
            "algorithm.kl_in_reward=false", "critic.enable=false", f"reward.terms={CONSTANT_REWARD}",
            f"trainer.steps={w['steps']}", f"trainer.run_dir={run_dir}", f"trainer.seed={w['seed']}",
            "trainer.export_hf=false", "trainer.save_last=false", "trainer.save_every=0",
            "trainer.tensorboard=false", "trainer.resume=false"]


def run_logged(cmd: list[str], log_path: str, timeout: float) -> tuple[int, float]:
    """Runs ``cmd`` in its own process group, output to ``log_path``; kills the group on timeout (rc 124)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = 124
            kill_group(proc)
    return code, time.perf_counter() - start


def kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group ``proc`` leads (torchrun passes it on), then SIGKILL to what is left."""
    for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass


def tail(path: str, chars: int = 3000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-chars:]


def error_lines(path: str, n: int = 8) -> list[str]:
    """The first distinct lines that name an error (the root cause sits above torchrun's summary)."""
    with open(path, errors="replace") as f:
        hits = [line.strip()[:300] for line in f if re.search(r"Error|error:|Exception", line)]
    return list(dict.fromkeys(hits))[:n]


def finish(out: dict, code: int, wall: float, log_path: str, timeout: float) -> dict:
    out.update(returncode=code, wall_s=wall, log=log_path)
    if code:
        out["error"] = f"timed out after {timeout:.0f} s" if code == 124 else f"exit code {code}"
        out["error_lines"] = error_lines(log_path)
        out["log_tail"] = tail(log_path)
    return out


def run_megarl(w: dict, args, overrides: list[str], log_path: str, name: str = "megarl") -> dict:
    run_dir = os.path.join(args.work, f"{name}_run")
    subprocess.run(["rm", "-rf", run_dir])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "launch/ppo.py",
           w["megarl_config"], *megarl_overrides(w, run_dir), *overrides]
    code, wall = run_logged(cmd, log_path, args.timeout)
    out = {"cmd": cmd}
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.isfile(metrics):
        steps = [r for r in map(json.loads, open(metrics)) if "perf/step_seconds" in r]
        if len(steps) >= 2:
            out.update(megarl_numbers(steps, summarize(run_dir), w["sequences_per_step"]))
    return finish(out, code, wall, log_path, args.timeout)


def megarl_numbers(steps: list[dict], m: dict, sequences: int) -> dict:
    """From metrics.jsonl's step rows and their medians after the warm-up step (bench_ppo.summarize)."""
    step_s, rollout_s = [r["perf/step_seconds"] for r in steps], [r["timing/rollout"] for r in steps]
    tok_s = [r["perf/tokens_per_s_per_gpu"] for r in steps]  # one GPU: the step's tokens / its seconds
    tokens = round(statistics.median(t * x for t, x in zip(tok_s[1:], step_s[1:])))  # a count: rate x seconds
    response = m.get("response/length_mean", 0.0)
    return dict(step_s=m["perf/step_seconds"], tokens_per_s=statistics.median(tok_s[1:]),
                rollout_s=m["timing/rollout"], rollout_frac=m["timing/rollout"] / m["perf/step_seconds"],
                tokens_per_step=tokens, response_len_mean=response, prompt_len_mean=tokens / sequences - response,
                actor_update_s=m.get("timing/actor_update"),
                step_s_all=step_s, tokens_per_s_all=tok_s, rollout_s_all=rollout_s, median=m,
                steps_measured=m["steps_measured"])


def run_trl(w: dict, args, log_path: str) -> dict:
    spec = dict(w, output_dir=os.path.join(args.work, "trl_run"), result=os.path.join(args.work, "trl_steps.json"))
    if os.path.exists(spec["result"]):
        os.remove(spec["result"])
    spec_path = os.path.join(args.work, "trl_spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f, indent=1)
    code, wall = run_logged([sys.executable, os.path.abspath(__file__), "--trl-worker", spec_path],
                            log_path, args.timeout)
    out = {}
    if os.path.isfile(spec["result"]):  # written after every step, so a run cut short still has its steps
        raw = json.load(open(spec["result"]))
        out.update({k: v for k, v in raw.items() if k not in ("step_s", "tokens", "generate_s")})
        if len(raw["step_s"]) >= 2:
            out.update(trl_numbers(raw, w["sequences_per_step"]))
    return finish(out, code, wall, log_path, args.timeout)


def trl_numbers(raw: dict, sequences: int) -> dict:
    """Medians after the warm-up step of the worker's per-step records."""
    step_s, tokens, gen = raw["step_s"], raw["tokens"], raw["generate_s"]
    tok_s = [t / x for t, x in zip(tokens, step_s)]
    med_step, med_gen, med_tokens = (statistics.median(v[1:]) for v in (step_s, gen, tokens))
    response = statistics.median(raw["completion_len_mean"][1:] or raw["completion_len_mean"] or [0.0])
    return dict(step_s=med_step, tokens_per_s=statistics.median(tok_s[1:]), generate_s=med_gen,
                generate_frac=med_gen / med_step, tokens_per_step=med_tokens, response_len_mean=response,
                prompt_len_mean=med_tokens / sequences - response, step_s_all=step_s, tokens_per_s_all=tok_s,
                generate_s_all=gen, steps_measured=len(step_s) - 1)


# ---- the TRL side, in its own process ---------------------------------------------------------

def _sync(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()


def _step_clock(result_path: str, cuda: bool):
    """A TrainerCallback: wall seconds, tokens and generate seconds per optimizer step, dumped each step."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.rec = {"step_s": [], "tokens": [], "generate_s": [], "completion_len_mean": [], "trl_step_time": []}
            self.generate_calls: list[float] = []
            self._t, self._seen = None, 0

        def on_step_begin(self, args, state, control, **kw):
            if self._t is None:  # later steps run from the previous step's end: data and logging included
                _sync(cuda)
                self._t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            _sync(cuda)
            now = time.perf_counter()
            self.rec["step_s"].append(now - self._t)
            self.rec["tokens"].append(state.num_input_tokens_seen - self._seen)  # prompt + completion tokens
            self.rec["generate_s"].append(sum(self.generate_calls))
            self._t, self._seen = now, state.num_input_tokens_seen
            self.generate_calls.clear()
            if cuda:
                import torch

                self.rec["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
            self.dump()

        def on_log(self, args, state, control, logs=None, **kw):  # after on_step_end (logging_steps=1)
            if logs and "completions/mean_length" in logs:
                self.rec["completion_len_mean"].append(logs["completions/mean_length"])
                self.rec["trl_step_time"].append(logs.get("step_time"))  # TRL's own: its training_step calls
                self.dump()

        def dump(self):
            with open(result_path, "w") as f:
                json.dump(self.rec, f)

    return StepClock()


def _time_generate(model, calls: list[float], cuda: bool) -> None:
    """Wraps ``type(model).generate`` so every call's wall seconds (synchronized) land in ``calls``."""
    cls = type(model)
    inner = cls.generate

    def generate(self, *a, **kw):
        _sync(cuda)
        t = time.perf_counter()
        out = inner(self, *a, **kw)
        _sync(cuda)
        calls.append(time.perf_counter() - t)
        return out

    cls.generate = generate


def trl_config(w: dict):
    from trl import GRPOConfig

    cpu, length = w["device"] == "cpu", w["response_tokens"]
    return GRPOConfig(
        output_dir=w["output_dir"], report_to=[], logging_steps=1, save_strategy="no", disable_tqdm=True,
        use_cpu=cpu, bf16=w["dtype"] == "bfloat16", fp16=False, seed=w["seed"], max_steps=w["steps"],
        per_device_train_batch_size=w["micro_batch"], gradient_accumulation_steps=w["grad_accum"],
        num_generations=w["samples_per_prompt"], num_iterations=1, max_completion_length=length,
        generation_kwargs={"min_new_tokens": length}, temperature=w["temperature"], top_p=1.0, top_k=0,
        beta=w["beta"], learning_rate=w["lr"], lr_scheduler_type="constant", warmup_steps=0,
        max_grad_norm=w["clip_grad"], weight_decay=0.0, use_vllm=False,
        gradient_checkpointing=w["trl_gradient_checkpointing"], dataloader_num_workers=0,
        model_init_kwargs={"dtype": w["trl_param_dtype"], "attn_implementation": "sdpa"},
        # MoE (bench_moe_e2e.py): the load-balancing loss as megarl's actor.moe_aux_loss_coef
        **({"router_aux_loss_coef": w["router_aux_loss_coef"]} if "router_aux_loss_coef" in w else {}))


def trl_worker(spec_path: str) -> None:
    """GRPOTrainer on the workload in ``spec_path``; per-step numbers go to the spec's ``result`` file."""
    import accelerate
    import datasets
    import huggingface_hub
    import torch
    import transformers
    import trl

    sys.path.insert(0, ROOT)
    from megarl.data.tokenizer import load_tokenizer  # AutoTokenizer mangles the synthetic tokenizers

    w = json.load(open(spec_path))
    cuda = w["device"] == "cuda"
    rows = [json.loads(line) for line in open(w["prompts_path"]) if line.strip()]
    data = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}]} for r in rows])
    clock = _step_clock(w["result"], cuda)
    trainer = trl.GRPOTrainer(model=w["model"], reward_funcs=constant_reward, args=trl_config(w),
                              train_dataset=data, processing_class=load_tokenizer(w["tokenizer"]),
                              callbacks=[clock])
    _time_generate(trainer.model, clock.generate_calls, cuda)
    clock.rec.update(versions={m.__name__: m.__version__ for m in (trl, transformers, torch, accelerate, datasets,
                                                                     huggingface_hub)},
                     loss_type=trainer.args.loss_type, param_dtype=str(trainer.model.dtype),
                     ref_model=trainer.ref_model is not None)
    trainer.train()


# ---- report ---------------------------------------------------------------------------------

def rc_cost(result: dict) -> None:
    """``rollout_correction_cost_pct``: the update's median seconds with rollout correction over without."""
    plain, rc = (result.get(side, {}).get("actor_update_s") for side in ("megarl", "megarl_rc"))
    if plain and rc:
        result["rollout_correction_cost_pct"] = 100.0 * (rc - plain) / plain


def table(result: dict) -> str:
    def cell(v, width: int, prec: int) -> str:
        return f"{v:{width}.{prec}f}" if isinstance(v, (int, float)) else f"{'-':>{width}}"

    lines = [f"{'side':<8} {'step s':>8} {'tokens/s':>10} {'rollout s':>10} {'rollout %':>10}  note"]
    for side, roll in (("megarl", "rollout_s"), ("trl", "generate_s")):
        r = result[side]
        frac = r[roll] / r["step_s"] * 100 if r.get(roll) is not None and r.get("step_s") else None
        note = "skipped" if r.get("skipped") else "; ".join([r.get("error", "")] + r.get("error_lines", [])[:1])
        note = note.strip("; ")[:100] + (" (rollout = model.generate)" if side == "trl" else "")
        lines.append(f"{side:<8} {cell(r.get('step_s'), 8, 2)} {cell(r.get('tokens_per_s'), 10, 0)} "
                     f"{cell(r.get(roll), 10, 2)} {cell(frac, 10, 1)}  {note.strip()}")
    speedup = result["megarl"].get("speedup_vs_trl")
    lines.append(f"speedup (megarl tokens/s / TRL tokens/s): {cell(speedup, 0, 2).strip()}x")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=f"defaults: {DEFAULTS}")
    ap.add_argument("--tiny", action="store_true", help=f"CPU smoke test: tiny model, {TINY}")
    ap.add_argument("--shape", default="qwen2.5-1.5b", help="make_checkpoint.py shape")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the real shape")
    ap.add_argument("--config", default="yaml/qwen2.5-1.5b.yaml", help="megarl yaml the overrides go on")
    ap.add_argument("--prompt-len", type=int, default=64, help="words per prompt (the template adds ~5 tokens)")
    ap.add_argument("--prompts", type=int, help="prompts per step")
    ap.add_argument("--samples", type=int, help="samples per prompt")
    ap.add_argument("--response-len", type=int, help="tokens per response, forced on both sides")
    ap.add_argument("--micro", type=int, help="sequences per forward/backward")
    ap.add_argument("--steps", type=int, help="steps; the first is warm-up and dropped")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--beta", type=float, default=0.001, help="KL loss coefficient")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], help="parameter dtype")
    ap.add_argument("--trl-param-dtype", default=None, choices=["bfloat16", "float32"], help="default: --dtype")
    ap.add_argument("--trl-gradient-checkpointing", action="store_true", help="GRPOConfig's own default")
    ap.add_argument("--sides", default="megarl,trl", help="comma list of megarl, trl")
    ap.add_argument("--timeout", type=float, default=260, help="seconds per side (two fit in one 600 s call)")
    ap.add_argument("--work", default="/tmp/megarl_e2e")
    ap.add_argument("--out", default="bench_e2e.json")
    ap.add_argument("--trl-worker", metavar="SPEC", help=argparse.SUPPRESS)
    args, overrides = ap.parse_known_args()
    if args.trl_worker:
        return trl_worker(args.trl_worker)
    sides = args.sides.split(",")
    if not sides or set(sides) - {"megarl", "megarl_rc", "trl"}:
        ap.error(f"--sides {args.sides}: expected a comma list of megarl, megarl_rc, trl")
    for key, value in (TINY if args.tiny else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    os.makedirs(args.work, exist_ok=True)
    w = workload(args)
    stem = os.path.splitext(os.path.abspath(args.out))[0]
    runners = {"megarl": lambda: run_megarl(w, args, overrides, stem + ".megarl.log"),
               "megarl_rc": lambda: run_megarl(w, args, overrides + RC_OVERRIDES, stem + ".megarl_rc.log", "megarl_rc"),
               "trl": lambda: run_trl(w, args, stem + ".trl.log")}
    result = {"megarl": {"skipped": True}, "trl": {"skipped": True}, "workload": dict(w, megarl_overrides=overrides)}
    for side in sides:  # the JSON is rewritten after each side, so a run cut short keeps what finished
        result[side] = runners[side]()
        rc_cost(result)
        if result["megarl"].get("tokens_per_s") and result["trl"].get("tokens_per_s"):
            result["megarl"]["speedup_vs_trl"] = result["megarl"]["tokens_per_s"] / result["trl"]["tokens_per_s"]
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if "megarl_rc" in sides:  # the terms alone, on the run's shapes: the A/B above carries the update's spread
        result["rollout_correction_terms"] = correction_terms(
            w["micro_batch"], w["response_tokens"], w["sequences_per_step"] // w["micro_batch"],
            result["megarl_rc"].get("actor_update_s"), preset=RC_OVERRIDES[0].rpartition("=")[2])
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps({k: {i: v for i, v in r.items() if not i.endswith(("_all", "tail", "median", "cmd"))}
                      if isinstance(r, dict) else r for k, r in result.items()}, indent=1))
    print(f"\nwrote {args.out}\n" + table(result))
    if "rollout_correction_cost_pct" in result:
        print(f"rollout correction ({' '.join(RC_OVERRIDES)}): the update takes "
              f"{result['rollout_correction_cost_pct']:+.2f}% longer")
    if result.get("rollout_correction_terms", {}).get("terms_pct_of_update") is not None:
        terms = result["rollout_correction_terms"]
        print(f"the correction terms alone: {terms['terms_ms_per_step']:.3f} ms a step, "
              f"{terms['terms_pct_of_update']:.3f}% of the update")
    sys.exit(0 if all(result[s].get("returncode") == 0 for s in sides) else 1)


if __name__ == "__main__":
    main()
