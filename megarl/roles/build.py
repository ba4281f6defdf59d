"""Roles from the run config: build the Megatron stage, load HF weights, wrap for training."""
from __future__ import annotations

import torch

from megarl.config import Config, OptimConfig
from megarl.distributed import ParallelGroups
from megarl.models.builder import ModelOptions, build_gpt_model
from megarl.models.hf_config import read_hf_config
from megarl.models.loader import load_hf_checkpoint
from megarl.models.lora import LoraOptions, adapters_off, apply_lora
from megarl.models.router_replay import ReplayRouters
from megarl.models.value_head import load_value_model
from megarl.algos.rollout_correction import from_section as rollout_correction
from megarl.roles.base import RunOptions
from megarl.roles.optim import build_trainable
from megarl.roles.policy import Policy
from megarl.roles.value import Critic, RewardModel

_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
VALUE_HEAD_INIT_STD = 1e-3  # a value head started from a causal LM: small, seeded, same on every rank


def model_options(cfg: Config, recompute: str = "none", moe_losses: bool = False) -> ModelOptions:
    """How to build a role's model; ``recompute`` only for the trained roles (actor, critic),
    ``moe_losses`` (actor.moe_aux_loss_coef / moe_z_loss_coef) only for the actor."""
    return ModelOptions(
        attention_backend=cfg.model.attention_backend,
        layer_spec=cfg.model.layer_spec,
        params_dtype=_DTYPES[cfg.model.dtype],
        make_vocab_size_divisible_by=cfg.model.vocab_divisible_by,
        seq_length=cfg.data.max_prompt_len + cfg.rollout.max_new_tokens,
        sequence_parallel=cfg.parallel.sequence_parallel,
        recompute=recompute,
        moe_aux_loss_coef=cfg.actor.moe_aux_loss_coef if moe_losses else 0.0,
        moe_z_loss_coef=cfg.actor.moe_z_loss_coef if moe_losses else 0.0,
        moe_experts=cfg.model.moe_experts,
    )


def build_module(path: str, cfg: Config, groups: ParallelGroups, value_head: bool = False,
                 recompute: str = "none", moe_losses: bool = False):
    """(module, info): this rank's stage of the checkpoint at ``path``, weights loaded."""
    info = read_hf_config(path)
    opts = model_options(cfg, recompute, moe_losses)
    if value_head:
        info = info.as_value_model() if not info.value_head else info
        module = build_gpt_model(info, groups, opts)
        load_value_model(module, path, info, groups, seed=cfg.trainer.seed, std=VALUE_HEAD_INIT_STD)
        return module, info
    module = build_gpt_model(info, groups, opts)
    load_hf_checkpoint(module, path, info, groups)
    return module, info


def run_options(cfg: Config, packing: bool, dp_balance: bool = True) -> RunOptions:
    """A role's micro-batch layout; a packed row under sequence parallelism splits evenly over TP."""
    p = cfg.parallel
    return RunOptions(packing=packing, pad_multiple=p.tp if p.sequence_parallel else 1,
                      dp_balance=dp_balance and p.dp_balance)


def _trainable(module, cfg: Config, groups, optim: OptimConfig, steps: int):
    return build_trainable(module, groups, optim, steps, cfg.parallel.distributed_optimizer)


def keep_layer_inputs_differentiable(module) -> None:
    """Full recompute under a frozen embedding (LoRA): the embedding's output requires grad.

    megatron's full recompute is a reentrant checkpoint per layer; its output
    requires grad only if an *input* does, not a parameter inside. With the
    embedding frozen, the first layer's input would not, so the adapters would
    get no gradient. Marking the (leaf, frozen) embedding output as requiring
    grad changes no value and costs one unused (s, b, h) gradient.
    """
    embedding = getattr(module, "embedding", None)  # absent on later pipeline stages (input from p2p)
    if embedding is None or any(p.requires_grad for p in embedding.parameters()):
        return
    embedding.register_forward_hook(_output_requires_grad)


def _output_requires_grad(_module, _inputs, out: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and not out.requires_grad:
        out.requires_grad_(True)  # (s, b, h): a leaf, as nothing before it is trained
    return out


def build_actor(cfg: Config, groups: ParallelGroups, optimizer_steps: int) -> Policy:
    module, info = build_module(cfg.model.path, cfg, groups, recompute=cfg.actor.recompute,
                                moe_losses=True)
    if cfg.actor.lora.rank:  # base frozen before DDP: only the adapters get grad buffers and Adam state
        lo = cfg.actor.lora
        apply_lora(module, LoraOptions(rank=lo.rank, alpha=lo.alpha, targets=tuple(lo.targets), seed=cfg.trainer.seed,
                                       experts=lo.experts))
        if cfg.actor.recompute == "full":
            keep_layer_inputs_differentiable(module)
    return Policy("actor", module, groups, info, _trainable(module, cfg, groups, cfg.actor.optim, optimizer_steps),
                  run_options(cfg, cfg.actor.packing), correction=rollout_correction(cfg.algorithm.rollout_correction),
                  replay=router_replay(cfg, module, info, groups))


class BasePolicy(Policy):
    """A LoRA actor's reference: the actor's own module with its adapters off (no second copy)."""

    def run(self, micro_batches, head, forward_only: bool):
        with adapters_off(self.module):
            return super().run(micro_batches, head, forward_only)


def build_reference(cfg: Config, groups: ParallelGroups, actor: Policy | None = None) -> Policy:
    """The frozen reference; with LoRA and no ref.path, the actor's base weights (shared)."""
    if actor is not None and cfg.actor.lora.rank and not cfg.ref.path:
        return BasePolicy("ref", actor.module, groups, actor.info, options=run_options(cfg, cfg.actor.packing))
    module, info = build_module(cfg.ref.path or cfg.model.path, cfg, groups)
    module.requires_grad_(False)
    return Policy("ref", module, groups, info, options=run_options(cfg, cfg.actor.packing),
                  replay=router_replay(cfg, module, info, groups))


def router_replay(cfg: Config, module, info, groups: ParallelGroups) -> ReplayRouters | None:
    """actor.router_replay=r3: the routers of a policy's MoE layers replay the rollout's expert ids (a
    dense reference, from ref.path, routes nothing)."""
    if cfg.actor.router_replay != "r3" or info.moe is None:
        return None
    return ReplayRouters(module, groups, info.moe.num_experts, info.moe.topk, info.num_layers)


def build_critic(cfg: Config, groups: ParallelGroups, optimizer_steps: int) -> Critic:
    module, info = build_module(cfg.critic.path or cfg.model.path, cfg, groups, value_head=True,
                                recompute=cfg.critic.recompute)
    return Critic("critic", module, groups, info, _trainable(module, cfg, groups, cfg.critic.optim, optimizer_steps),
                  run_options(cfg, cfg.critic.packing))


def build_reward_model(cfg: Config, groups: ParallelGroups) -> RewardModel:
    module, info = build_module(cfg.reward.model.path, cfg, groups, value_head=True)
    module.requires_grad_(False)
    # no DP balancing: reward scoring need not run on every DP rank at once (cached scores)
    return RewardModel("reward_model", module, groups, info,
                       options=run_options(cfg, cfg.reward.model.packing, dp_balance=False))
