"""The entry points: :func:`validate` for PPO runs, :func:`validate_sft` for launch/sft.py."""
from __future__ import annotations

from megarl.errors import ConfigError
from megarl.config import Config
from megarl.config_checks.common import check_counts, read_hf_config
from megarl.config_checks.inputs import check_data, check_model_inputs, check_paths, check_sft_data
from megarl.config_checks.layout import (check_async, check_batches, check_context_parallel, check_model,
                                         check_packing, check_parallel, training_world)
from megarl.config_checks.moe import check_moe_rollout, check_router_replay
from megarl.config_checks.rollout import (check_multi_turn, check_partial, check_rollout, check_server, check_sglang,
                                          check_stop_tokens)
from megarl.config_checks.training import (check_actor, check_algorithm, check_critic, check_cpu_offload, check_dapo,
                                           check_optim, check_reward, check_rollout_correction, check_trainer)
from megarl.models.hub import resolve_hub_models


def validate_sft(cfg: Config, world_size: int) -> dict:
    """Checks for launch/sft.py."""
    resolve_hub_models(cfg)
    hf = read_hf_config(cfg.model.path)
    check_parallel(cfg, world_size, hf)
    check_model(cfg)
    p, s = cfg.parallel, cfg.sft
    if p.cp > 1:
        raise ConfigError(f"parallel.cp={p.cp}: launch/sft.py trains padded rows, which context parallelism "
                          "does not split; set parallel.cp=1")
    check_counts(s, "sft", ["epochs", "batch_size", "micro_batch_size", "max_len"])
    check_optim(s.optim, "sft.optim")
    check_cpu_offload(cfg, s.optim, "sft.optim")
    check_model_inputs(cfg, hf, "sft.max_len", s.max_len, room=0)
    dp = world_size // (p.tp * p.pp * p.cp)
    if s.batch_size % dp or (s.batch_size // dp) % s.micro_batch_size:
        raise ConfigError(
            f"sft.batch_size={s.batch_size} must split evenly into {dp} DP ranks of sft.micro_batch_size={s.micro_batch_size}"
        )
    check_sft_data(s)
    return hf


def validate(cfg: Config, world_size: int) -> dict:
    """Runs every check; returns the policy's HF config for the caller. Hub ids in the model paths
    become their local snapshot directories first (megarl/models/hub.py)."""
    resolve_hub_models(cfg)
    hf = read_hf_config(cfg.model.path)
    check_async(cfg, world_size, hf)
    world_size = training_world(cfg, world_size)  # the ranks that train (all of them in sync mode)
    check_parallel(cfg, world_size, hf)
    check_model(cfg)
    check_rollout(cfg)  # before the batch sizes, which depend on rollout.n
    check_moe_rollout(cfg, hf)
    check_router_replay(cfg, hf)
    check_stop_tokens(cfg, hf)
    check_model_inputs(cfg, hf, "rollout.max_new_tokens", cfg.rollout.max_new_tokens, room=1)
    check_multi_turn(cfg)
    check_server(cfg)
    check_sglang(cfg)
    check_batches(cfg, world_size)
    check_actor(cfg)
    check_critic(cfg)
    check_packing(cfg)
    check_context_parallel(cfg)
    check_algorithm(cfg)
    check_rollout_correction(cfg)
    check_dapo(cfg)
    check_partial(cfg)
    check_reward(cfg)
    check_trainer(cfg)
    check_paths(cfg)
    check_data(cfg)
    return hf
