"""Evaluation without training: torchrun --nproc_per_node N launch/eval.py CONFIG.yaml [key=value ...]
    [--checkpoint RUN_DIR | RUN_DIR/checkpoints/step_N] [--out FILE.json]

Evaluates model.path (a Hugging Face directory or hub id; e.g. model.path=runs/tiny/hf), or with
--checkpoint the actor of a training checkpoint (a run directory: its newest), on data.eval_sets
(pass@k, mean@n) and data.eval_path (held-out accuracy). Prints one line per set; --out also writes
the metrics as JSON. The config is the run's own yaml (model, rollout and data settings).
"""
import json
import sys

import torch.distributed as dist

from megarl.cli import main_guard
from megarl.config import Config
from megarl.errors import ConfigError
from megarl.launch_common import setup


def pop_flag(argv: list[str], flag: str) -> str | None:
    """Removes ``flag VALUE`` (or ``flag=VALUE``) from argv; returns VALUE."""
    for i, arg in enumerate(argv):
        if arg == flag:
            if i + 1 >= len(argv):
                raise ConfigError(f"{flag} needs a value, e.g. {flag} runs/tiny")
            value = argv[i + 1]
            del argv[i:i + 2]
            return value
        if arg.startswith(flag + "="):
            del argv[i]
            return arg.split("=", 1)[1]
    return None


def main(argv):
    argv = list(argv)
    checkpoint, out = pop_flag(argv, "--checkpoint"), pop_flag(argv, "--out")
    cfg, rank = setup(argv, Config)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.data.tokenizer import load_tokenizer
    from megarl.distributed import build_parallel_groups
    from megarl.monitor.progress import stage
    from megarl.rollout.factory import build_engine
    from megarl.trainer.eval_only import evaluate_all, load_policy

    p = cfg.parallel
    groups = build_parallel_groups(p.tp, p.pp, p.cp)
    model_parallel_cuda_manual_seed(cfg.trainer.seed)
    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    with stage(f"loading {checkpoint or cfg.model.path}", rank == 0):
        policy = load_policy(cfg, groups, checkpoint)
    stop_ids = [] if cfg.rollout.ignore_eos or tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    engine = build_engine(cfg, policy, groups, tokenizer, stop_ids + list(cfg.rollout.stop_token_ids), pad_id)
    metrics = evaluate_all(cfg, engine, tokenizer, groups, say=rank == 0)
    if rank == 0 and out:
        with open(out, "w") as f:
            json.dump(metrics, f, indent=2, sort_keys=True)
    dist.destroy_process_group()


if __name__ == "__main__":  # guard: dist_checkpointing's manager re-imports __main__
    main_guard(main, sys.argv[1:], cls=Config, usage=__doc__)
