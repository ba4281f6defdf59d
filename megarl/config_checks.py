"""Cross-field checks of a :class:`megarl.config.Config`, one short function per section.

Each failure is a :class:`ConfigError` that names the key and the fix.
"""
from __future__ import annotations

import json
from pathlib import Path

from megarl.cli import ConfigError
from megarl.config import Config

GROUP_ADVANTAGES = {"grpo", "rloo", "reinforce_pp_baseline"}


def read_hf_config(path: str, key: str = "model.path") -> dict:
    """config.json of a Hugging Face directory, or a ConfigError naming ``key``."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"{key}: '{path}' has no config.json; point it at a Hugging Face model directory")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{cfg_file}:{e.lineno}: invalid JSON ({e.msg})") from None


def check_parallel(cfg: Config, world_size: int, hf: dict) -> None:
    p = cfg.parallel
    for key in ("tp", "pp", "cp"):
        if getattr(p, key) < 1:
            raise ConfigError(f"parallel.{key} must be >= 1")
    model_parallel = p.tp * p.pp * p.cp
    if world_size % model_parallel:
        raise ConfigError(
            f"world size {world_size} is not divisible by parallel.tp*pp*cp = {p.tp}*{p.pp}*{p.cp}; "
            f"use a multiple of {model_parallel} processes or smaller sizes"
        )
    heads = hf.get("num_attention_heads", 1)
    kv_heads = hf.get("num_key_value_heads") or heads
    if heads % p.tp or kv_heads % p.tp:
        raise ConfigError(
            f"parallel.tp={p.tp} must divide the attention heads ({heads}) and key/value heads ({kv_heads})"
        )
    if (heads // p.tp) % p.cp:
        raise ConfigError(f"parallel.cp={p.cp} must divide the heads per TP rank ({heads // p.tp}) for Ulysses")
    layers = hf.get("num_hidden_layers", 1)
    if layers % p.pp:
        raise ConfigError(f"parallel.pp={p.pp} must divide num_hidden_layers ({layers})")


def check_batches(cfg: Config, world_size: int) -> None:
    p = cfg.parallel
    dp = world_size // (p.tp * p.pp * p.cp)
    samples = cfg.data.batch_size * cfg.rollout.n
    if cfg.data.batch_size % dp:
        raise ConfigError(f"data.batch_size={cfg.data.batch_size} must be a multiple of the data-parallel size {dp}")
    mini = cfg.actor.mini_batch_size
    if mini <= 0 or samples % mini:
        raise ConfigError(
            f"actor.mini_batch_size={mini} must divide data.batch_size*rollout.n = {samples}"
        )
    if mini % dp:
        raise ConfigError(f"actor.mini_batch_size={mini} must be a multiple of the data-parallel size {dp}")
    for role in ("actor", "critic"):
        micro = getattr(cfg, role).micro_batch_size
        if micro <= 0 or (mini // dp) % micro:
            raise ConfigError(
                f"{role}.micro_batch_size={micro} must divide the per-GPU mini-batch "
                f"(actor.mini_batch_size / dp = {mini // dp})"
            )


def check_rollout(cfg: Config) -> None:
    r = cfg.rollout
    if r.n < 1 or r.max_new_tokens < 1:
        raise ConfigError("rollout.n and rollout.max_new_tokens must be >= 1")
    if r.temperature < 0 or not 0 < r.top_p <= 1:
        raise ConfigError("rollout.temperature must be >= 0 and rollout.top_p in (0, 1]")
    if r.max_batch < 1 or r.max_num_batched_tokens < 1:
        raise ConfigError("rollout.max_batch and rollout.max_num_batched_tokens must be >= 1")
    if r.page_size not in (8, 16, 32, 64, 128):
        raise ConfigError(f"rollout.page_size={r.page_size} must be a power of two in 8..128")
    if r.kv_cache_gb < 0 or not 0 < r.kv_cache_fraction <= 1:
        raise ConfigError("rollout.kv_cache_gb must be >= 0 and rollout.kv_cache_fraction in (0, 1]")
    if cfg.algorithm.advantage in GROUP_ADVANTAGES and r.n < 2:
        raise ConfigError(
            f"algorithm.advantage={cfg.algorithm.advantage} compares samples of one prompt; set rollout.n >= 2"
        )


def check_algorithm(cfg: Config) -> None:
    a, act = cfg.algorithm, cfg.actor
    if not (0 <= a.gamma <= 1 and 0 <= a.lam <= 1):
        raise ConfigError("algorithm.gamma and algorithm.lam must lie in [0, 1]")
    if act.clip_low < 0 or act.clip_high < 0:
        raise ConfigError("actor.clip_low and actor.clip_high must be >= 0")
    for key in ("gspo_clip_low", "gspo_clip_high"):
        if getattr(act, key) < 0:
            raise ConfigError(f"actor.{key}={getattr(act, key)} must be >= 0")
    if act.dual_clip and act.dual_clip <= 1:
        raise ConfigError(f"actor.dual_clip={act.dual_clip} must be > 1 (or 0 to disable)")
    if cfg.critic.enable is False and a.advantage == "gae":
        raise ConfigError("algorithm.advantage=gae needs values; set critic.enable=true or pick grpo/rloo/...")


def check_paths(cfg: Config) -> None:
    if not Path(cfg.data.train_path).is_file():
        raise ConfigError(f"data.train_path: '{cfg.data.train_path}' not found")
    if cfg.data.eval_path and not Path(cfg.data.eval_path).is_file():
        raise ConfigError(f"data.eval_path: '{cfg.data.eval_path}' not found; unset it to skip evaluation")
    for key, path in (("critic.path", cfg.critic.path), ("ref.path", cfg.ref.path),
                      ("reward.model.path", cfg.reward.model.path)):
        if path:
            read_hf_config(path, key)


def validate_sft(cfg: Config, world_size: int) -> dict:
    """Checks for launch/sft.py."""
    hf = read_hf_config(cfg.model.path)
    check_parallel(cfg, world_size, hf)
    p, s = cfg.parallel, cfg.sft
    dp = world_size // (p.tp * p.pp * p.cp)
    if s.batch_size % dp or (s.batch_size // dp) % s.micro_batch_size:
        raise ConfigError(
            f"sft.batch_size={s.batch_size} must split evenly into {dp} DP ranks of sft.micro_batch_size={s.micro_batch_size}"
        )
    if not Path(s.train_path).is_file():
        raise ConfigError(f"sft.train_path: '{s.train_path}' not found")
    return hf


def validate(cfg: Config, world_size: int) -> dict:
    """Runs every check; returns the policy's HF config for the caller."""
    hf = read_hf_config(cfg.model.path)
    check_parallel(cfg, world_size, hf)
    check_rollout(cfg)  # before the batch sizes, which depend on rollout.n
    check_batches(cfg, world_size)
    check_algorithm(cfg)
    check_paths(cfg)
    return hf


def uses_critic(cfg: Config) -> bool:
    """critic.enable, defaulting to "the advantage estimator needs values"."""
    return cfg.critic.enable if cfg.critic.enable is not None else cfg.algorithm.advantage == "gae"


def uses_ref(cfg: Config) -> bool:
    """ref.enable, defaulting to "some KL term is on"."""
    if cfg.ref.enable is not None:
        return cfg.ref.enable
    return cfg.algorithm.kl_in_reward or cfg.actor.kl_loss_coef > 0
