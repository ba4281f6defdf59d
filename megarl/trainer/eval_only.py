"""Evaluation without training (launch/eval.py): a policy from a HF directory or a training checkpoint.

    policy = load_policy(cfg, groups, checkpoint=None)        # model.path, a HF directory (or hub id)
    policy = load_policy(cfg, groups, "runs/x/checkpoints/step_000030")   # its actor, LoRA included
    metrics = evaluate_all(cfg, engine, tokenizer, groups, say=rank0)

A checkpoint's actor is built on ``model.path`` (the run's base model: its
architecture and tokenizer), its LoRA adapters attached as the checkpoint's
megarl_model.json says (else as ``actor.lora``), and its weights read from the
checkpoint; the optimizer, the critic and the trainer state are not read.
"""
from __future__ import annotations

from megarl.config import Config
from megarl.data.build import build_eval_sets, build_held_out
from megarl.errors import CheckpointError
from megarl.monitor.progress import note
from megarl.trainer.eval_sets import evaluate_named_sets
from megarl.trainer.evaluate import eval_count, held_out_accuracy


def load_policy(cfg: Config, groups, checkpoint: str | None = None):
    """A frozen Policy on ``model.path``, with the actor weights of ``checkpoint`` when given."""
    from megarl.models.lora import LoraOptions, apply_lora
    from megarl.models.mcore_ckpt import load_training_model, training_role_dir
    from megarl.roles.build import build_module, run_options
    from megarl.roles.policy import Policy

    module, info = build_module(cfg.model.path, cfg, groups)
    if checkpoint is not None:
        role_dir = training_role_dir(checkpoint)
        if role_dir is None:
            raise CheckpointError(f"--checkpoint {checkpoint}: not a training checkpoint (a run directory, its "
                                  "checkpoints/, or checkpoints/step_N holding state.json and actor/)")
        lora = _checkpoint_lora(role_dir, cfg)
        if lora:
            apply_lora(module, LoraOptions(rank=lora["rank"], alpha=lora["alpha"], targets=tuple(lora["targets"]),
                                           experts=lora.get("experts", False)))
        load_training_model(module, role_dir)
    module.requires_grad_(False)
    return Policy("actor", module, groups, info, options=run_options(cfg, cfg.actor.packing))


def _checkpoint_lora(role_dir: str, cfg: Config) -> dict | None:
    import json
    import os

    from megarl.models.mcore_ckpt import META

    path = os.path.join(role_dir, META)
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f).get("lora")
    lo = cfg.actor.lora
    return {"rank": lo.rank, "alpha": lo.alpha, "targets": lo.targets, "experts": lo.experts} if lo.rank else None


def evaluate_all(cfg: Config, engine, tokenizer, groups, say: bool) -> dict[str, float]:
    """data.eval_sets and data.eval_path (eval/accuracy), each with a console line on rank 0."""
    out = evaluate_named_sets(cfg, engine, build_eval_sets(cfg.data, tokenizer), tokenizer, groups, say)
    held_out = build_held_out(cfg.data, tokenizer)
    if held_out is not None:
        count = eval_count(len(held_out), cfg.trainer.eval_samples)
        acc = held_out_accuracy(engine, held_out, tokenizer, groups, cfg.rollout.max_new_tokens,
                                cfg.trainer.eval_samples)
        note(f"held-out accuracy {acc:.3f} on {count} prompts", say)
        out["eval/accuracy"] = acc
    return out
