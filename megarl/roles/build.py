"""Roles from the run config: build the Megatron stage, load HF weights, wrap for training."""
from __future__ import annotations

from megarl.config import Config, OptimConfig
from megarl.distributed import ParallelGroups
from megarl.models.builder import ModelOptions, build_gpt_model
from megarl.models.hf_config import read_hf_config
from megarl.models.loader import load_hf_checkpoint
from megarl.models.lora import LoraOptions, apply_lora
from megarl.models.value_head import load_value_model
from megarl.roles.base import RunOptions
from megarl.roles.optim import build_trainable
from megarl.roles.policy import Policy
from megarl.roles.value import Critic, RewardModel

_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
VALUE_HEAD_INIT_STD = 1e-3  # a value head started from a causal LM: small, seeded, same on every rank


def model_options(cfg: Config) -> ModelOptions:
    return ModelOptions(
        attention_backend=cfg.model.attention_backend,
        layer_spec=cfg.model.layer_spec,
        params_dtype=_DTYPES[cfg.model.dtype],
        make_vocab_size_divisible_by=cfg.model.vocab_divisible_by,
        seq_length=cfg.data.max_prompt_len + cfg.rollout.max_new_tokens,
        sequence_parallel=cfg.parallel.sequence_parallel,
    )


def build_module(path: str, cfg: Config, groups: ParallelGroups, value_head: bool = False):
    """(module, info): this rank's stage of the checkpoint at ``path``, weights loaded."""
    info = read_hf_config(path)
    if value_head:
        info = info.as_value_model() if not info.value_head else info
        module = build_gpt_model(info, groups, model_options(cfg))
        load_value_model(module, path, info, groups, seed=cfg.trainer.seed, std=VALUE_HEAD_INIT_STD)
        return module, info
    module = build_gpt_model(info, groups, model_options(cfg))
    load_hf_checkpoint(module, path, info, groups)
    return module, info


def run_options(cfg: Config, packing: bool, dp_balance: bool = True) -> RunOptions:
    """A role's micro-batch layout; a packed row under sequence parallelism splits evenly over TP."""
    p = cfg.parallel
    return RunOptions(packing=packing, pad_multiple=p.tp if p.sequence_parallel else 1,
                      dp_balance=dp_balance and p.dp_balance)


def _trainable(module, cfg: Config, groups, optim: OptimConfig, steps: int):
    return build_trainable(module, groups, optim, steps, cfg.parallel.distributed_optimizer)


def build_actor(cfg: Config, groups: ParallelGroups, optimizer_steps: int) -> Policy:
    module, info = build_module(cfg.model.path, cfg, groups)
    if cfg.actor.lora.rank:  # base frozen before DDP: only the adapters get grad buffers and Adam state
        lo = cfg.actor.lora
        apply_lora(module, LoraOptions(rank=lo.rank, alpha=lo.alpha, targets=tuple(lo.targets), seed=cfg.trainer.seed))
    return Policy("actor", module, groups, info, _trainable(module, cfg, groups, cfg.actor.optim, optimizer_steps),
                  run_options(cfg, cfg.actor.packing))


def build_reference(cfg: Config, groups: ParallelGroups) -> Policy:
    module, info = build_module(cfg.ref.path or cfg.model.path, cfg, groups)
    module.requires_grad_(False)
    return Policy("ref", module, groups, info, options=run_options(cfg, cfg.actor.packing))


def build_critic(cfg: Config, groups: ParallelGroups, optimizer_steps: int) -> Critic:
    module, info = build_module(cfg.critic.path or cfg.model.path, cfg, groups, value_head=True)
    return Critic("critic", module, groups, info, _trainable(module, cfg, groups, cfg.critic.optim, optimizer_steps),
                  run_options(cfg, cfg.critic.packing))


def build_reward_model(cfg: Config, groups: ParallelGroups) -> RewardModel:
    module, info = build_module(cfg.reward.model.path, cfg, groups, value_head=True)
    module.requires_grad_(False)
    # no DP balancing: reward scoring need not run on every DP rank at once (cached scores)
    return RewardModel("reward_model", module, groups, info,
                       options=run_options(cfg, cfg.reward.model.packing, dp_balance=False))
