"""Checks of what trains and how: actor, LoRA, critic, optimizers, algorithm, rewards, trainer."""
from __future__ import annotations

import importlib.util
import math
import os

from megarl.errors import ConfigError
from megarl.config import LORA_TARGETS, REDIS_URL, Config, DapoConfig, RolloutCorrectionConfig
from megarl.algos.advantages import get_advantage
from megarl.algos.rollout_correction import from_section as correction_from_section, keys_read
from megarl.algos.losses import get_policy_loss
from megarl.config_checks.common import (GROUP_ADVANTAGES, SCORE_ONLY_ADVANTAGES, check_counts, check_numbers,
                                         have_te, one_line_error, uses_critic)
from megarl.rewards.registry import get_reward


def check_optim(o, prefix: str) -> None:
    check_numbers(o, prefix, ["lr"], low=0, strict=True)
    check_numbers(o, prefix, ["min_lr", "weight_decay", "eps", "clip_grad"], low=0)
    check_counts(o, prefix, ["warmup_steps"], low=0)
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        raise ConfigError(f"{prefix}.betas={o.betas} must be two numbers in [0, 1), e.g. [0.9, 0.999]")


def check_cpu_offload(cfg: Config, o, prefix: str) -> None:
    """``<prefix>.cpu_offload``: megatron-core 0.16.1's HybridDeviceOptimizer under the distributed
    optimizer takes half-precision parameters only (an fp32 one reaches it as a non-leaf view and
    its constructor raises), and steps only parameters that live on a CUDA device. Every trained
    weight of a bf16/fp16 model is half precision, the local spec's norms included (built in the
    params dtype; ``tests/test_cpu_offload.py`` runs offload on a GPU)."""
    if not o.cpu_offload:
        return
    key = f"{prefix}.cpu_offload=true"
    if not cfg.parallel.distributed_optimizer:
        raise ConfigError(f"{key} needs parallel.distributed_optimizer=true (megatron-core offloads its shards); "
                          f"set it or {prefix}.cpu_offload=false")
    if cfg.model.dtype == "float32":
        raise ConfigError(f"{key} needs model.dtype=bfloat16 or float16 (megatron-core's offload cannot hold fp32 "
                          f"parameters); change the dtype or set {prefix}.cpu_offload=false")
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(f"{key} needs a CUDA device (megatron-core's offload moves GPU shards; on CPU the optimizer "
                          f"already runs in host memory); set {prefix}.cpu_offload=false")


def check_actor(cfg: Config) -> None:
    act = cfg.actor
    check_optim(act.optim, "actor.optim")
    check_cpu_offload(cfg, act.optim, "actor.optim")
    check_counts(act, "actor", ["ppo_epochs"])
    check_counts(act, "actor", ["forward_micro_batch_size"], low=0)
    check_numbers(act, "actor", ["kl_loss_coef", "entropy_coef", "moe_aux_loss_coef", "moe_z_loss_coef"], low=0)
    check_lora(cfg)


def check_lora(cfg: Config) -> None:
    lo = cfg.actor.lora
    if lo.rank == 0:
        return
    check_counts(lo, "actor.lora", ["rank"])
    check_numbers(lo, "actor.lora", ["alpha"], low=0, strict=True)
    bad = [t for t in lo.targets if t not in LORA_TARGETS]
    if bad or not lo.targets:
        raise ConfigError(f"actor.lora.targets={lo.targets}: pick from {list(LORA_TARGETS)}")
    if cfg.parallel.sequence_parallel:
        raise ConfigError("actor.lora.rank > 0 with parallel.sequence_parallel=true is not supported; turn one off")
    if cfg.model.layer_spec == "te" or (cfg.model.layer_spec == "auto" and have_te()):
        raise ConfigError("actor.lora needs the local layer spec (TE fuses the norm into QKV / fc1); "
                          "set model.layer_spec=local")
    if cfg.rollout.engine == "sglang" and cfg.trainer.mode == "sync":  # async: the push sends W + s B A merged
        raise ConfigError("actor.lora with rollout.engine=sglang is not supported yet (its weight stream sends "
                          "plain weights); use rollout.engine=native")


def check_critic(cfg: Config) -> None:
    if uses_critic(cfg):  # an unused critic's knobs are not checked
        check_optim(cfg.critic.optim, "critic.optim")
        check_cpu_offload(cfg, cfg.critic.optim, "critic.optim")
        check_counts(cfg.critic, "critic", ["ppo_epochs"])
        check_counts(cfg.critic, "critic", ["forward_micro_batch_size"], low=0)


def check_trainer(cfg: Config) -> None:
    t = cfg.trainer
    check_counts(t, "trainer", ["steps", "keep_last"])
    check_counts(t, "trainer", ["save_every", "eval_every", "eval_samples", "max_bad_updates"], low=0)
    check_counts(t, "trainer", ["export_every"], low=0)
    check_numbers(t, "trainer", ["monitor_interval_s"], low=0)
    check_numbers(t, "trainer", ["collective_timeout_s"], low=0, strict=True)
    if 0 < t.monitor_interval_s < 0.1:
        raise ConfigError(f"trainer.monitor_interval_s={t.monitor_interval_s}: sampling that often costs the run "
                          "CPU time; use >= 0.1 s, or 0 to turn the monitor off")
    check_wandb(t.wandb)


def check_wandb(w) -> None:
    if not w.enable:
        return
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("trainer.wandb.enable=true but wandb is not installed; "
                          "pip install megarl[wandb] (or set trainer.wandb.enable=false)")
    if not w.project:
        raise ConfigError("trainer.wandb.project is empty; name a W&B project, e.g. trainer.wandb.project=megarl")


def check_reward(cfg: Config) -> None:
    rw, rm = cfg.reward, cfg.reward.model
    if not rw.terms and not rm.path:
        raise ConfigError(
            "reward.terms=[] and reward.model.path is unset: nothing scores; add a term or set reward.model.path"
        )
    names = [t.name for t in rw.terms] + (["rm"] if rm.path else [])
    dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if dup is not None:
        raise ConfigError(f"reward.terms names '{dup}' twice (the reward model is 'rm'); give each term its own name")
    for i, t in enumerate(rw.terms):
        check_numbers(t, f"reward.terms[{i}]", ["weight"])
        try:
            get_reward(t.name)
        except (KeyError, ValueError) as e:
            raise ConfigError(f"reward.terms[{i}].name={t.name!r}: {one_line_error(e)}") from None
    check_numbers(rw, "reward", ["fallback"])
    check_numbers(rm, "reward.model", ["weight", "scale"])
    check_counts(rm, "reward.model", ["micro_batch_size"])
    check_reward_cache(rw)


def check_reward_cache(rw) -> None:
    """reward.cache and its keys; with redis, the server must answer a PING now."""
    if rw.cache_size < 0 or (rw.cache_size == 0 and rw.cache != "memory"):
        raise ConfigError(f"reward.cache_size={rw.cache_size} with reward.cache={rw.cache}: use a size > 0 "
                          "(0 turns the cache off, with reward.cache=memory)")
    if rw.cache == "memory" and rw.cache_path:
        raise ConfigError("reward.cache_path is read by reward.cache=sqlite or redis only; set one or unset the path")
    if rw.cache != "redis" and rw.redis_url != REDIS_URL:
        raise ConfigError(f"reward.redis_url is read by reward.cache=redis only (reward.cache={rw.cache}); "
                          "set reward.cache=redis or drop the URL")
    if rw.cache_path and os.path.isdir(rw.cache_path):
        raise ConfigError(f"reward.cache_path: '{rw.cache_path}' is a directory; name a file such as "
                          f"{os.path.join(rw.cache_path, 'reward_cache.sqlite')}")
    if rw.cache == "redis":
        from megarl.rewards.cache_redis import redis_url_problem

        problem = redis_url_problem(rw.redis_url)
        if problem:
            raise ConfigError(f"reward.redis_url={rw.redis_url}: {problem}, or set reward.cache=sqlite")


def check_algorithm(cfg: Config) -> None:
    a, act = cfg.algorithm, cfg.actor
    if not (0 <= a.gamma <= 1 and 0 <= a.lam <= 1):
        raise ConfigError("algorithm.gamma and algorithm.lam must lie in [0, 1]")
    check_numbers(a, "algorithm", ["kl_coef"], low=0)
    if act.clip_low < 0 or act.clip_high < 0:
        raise ConfigError("actor.clip_low and actor.clip_high must be >= 0")
    for key in ("gspo_clip_low", "gspo_clip_high"):
        if getattr(act, key) < 0:
            raise ConfigError(f"actor.{key}={getattr(act, key)} must be >= 0")
    if act.dual_clip and act.dual_clip <= 1:
        raise ConfigError(f"actor.dual_clip={act.dual_clip} must be > 1 (or 0 to disable)")
    for key, value, get in (("algorithm.advantage", a.advantage, get_advantage),
                            ("actor.policy_loss", act.policy_loss, get_policy_loss)):
        try:
            get(value)  # a dotted path imports here, not at the first step
        except ValueError as e:
            raise ConfigError(f"{key}={value!r}: {one_line_error(e)}") from None
    if cfg.critic.enable is False and a.advantage == "gae":
        raise ConfigError("algorithm.advantage=gae needs values; set critic.enable=true or pick grpo/rloo/...")
    if cfg.ref.enable is False and (a.kl_in_reward or act.kl_loss_coef > 0):
        key = "algorithm.kl_in_reward=true" if a.kl_in_reward else f"actor.kl_loss_coef={act.kl_loss_coef}"
        raise ConfigError(f"{key} needs the reference model but ref.enable=false; enable it or turn the KL term off")
    if a.kl_in_reward and a.advantage in SCORE_ONLY_ADVANTAGES:
        raise ConfigError(f"algorithm.kl_in_reward=true with algorithm.advantage={a.advantage}: its advantages read "
                          "sequence scores only, so the KL token rewards would be ignored; use actor.kl_loss_coef "
                          "(KL as a loss) or advantage gae / reinforce_pp_baseline")


def check_rollout_correction(cfg: Config) -> None:
    """algorithm.rollout_correction: a preset or the keys; thresholds in range; no key its mode ignores."""
    rc, key = cfg.algorithm.rollout_correction, "algorithm.rollout_correction"
    default = RolloutCorrectionConfig()
    changed = [k for k in ("mode", "cap", "level", "seq_ratio", "low", "high") if getattr(rc, k) != getattr(default, k)]
    if rc.preset != "none" and changed:
        raise ConfigError(f"{key}.preset={rc.preset} sets the mode and thresholds itself; drop "
                          f"{key}.{changed[0]}={getattr(rc, changed[0])} or set {key}.preset=none")
    read = keys_read(correction_from_section(rc))
    if "cap" in read and not (math.isfinite(rc.cap) and rc.cap >= 1):
        raise ConfigError(f"{key}.cap={rc.cap} must be a finite number >= 1 (a cap below 1 would down-weight "
                          "tokens on which both policies agree)")
    if "low" in read and not 0 < rc.low < 1:
        raise ConfigError(f"{key}.low={rc.low} must be in (0, 1): the band must hold ratio 1")
    if "high" in read and not 1 < rc.high < math.inf:
        raise ConfigError(f"{key}.high={rc.high} must be a finite number > 1: the band must hold ratio 1")
    unread = next((k for k in changed if k != "mode" and k not in read), None)
    if unread:
        raise ConfigError(f"{key}.{unread}={getattr(rc, unread)} is not read by {key}.mode={rc.mode}; "
                          f"drop it or pick a mode that reads it")


def check_dapo(cfg: Config) -> None:
    """algorithm.dapo: dynamic sampling needs group advantages; the overlong buffer fits the response."""
    d, key = cfg.algorithm.dapo, "algorithm.dapo"
    check_counts(d, key, ["max_rounds"])
    check_counts(d, key, ["overlong_buffer"], low=0)
    check_numbers(d, key, ["overlong_penalty"], low=0)
    if d.overlong_buffer > cfg.rollout.max_new_tokens:
        raise ConfigError(f"{key}.overlong_buffer={d.overlong_buffer} must be <= rollout.max_new_tokens="
                          f"{cfg.rollout.max_new_tokens} (the buffer ends at the response limit)")
    default = DapoConfig()
    if not d.overlong_buffer and d.overlong_penalty != default.overlong_penalty:
        raise ConfigError(f"{key}.overlong_penalty is read only with {key}.overlong_buffer > 0; set the buffer "
                          "or drop the penalty")
    if not d.dynamic_sampling:
        if d.max_rounds != default.max_rounds:
            raise ConfigError(f"{key}.max_rounds is read only with {key}.dynamic_sampling=true; set it or drop "
                              "max_rounds")
        return
    if cfg.algorithm.advantage not in GROUP_ADVANTAGES:
        raise ConfigError(f"{key}.dynamic_sampling=true keeps groups whose scores differ, a signal only group "
                          f"advantages read ({', '.join(sorted(GROUP_ADVANTAGES))}); algorithm.advantage="
                          f"{cfg.algorithm.advantage}: pick one of them or set {key}.dynamic_sampling=false")
    if cfg.trainer.replay_rollouts:
        raise ConfigError(f"{key}.dynamic_sampling=true generates; trainer.replay_rollouts trains on dumped "
                          f"batches as they are: set {key}.dynamic_sampling=false to replay")
