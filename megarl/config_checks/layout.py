"""Checks of the model and its layout: layer spec, packing, TP/PP/CP sizes, batch sizes, async placement."""
from __future__ import annotations

from megarl.errors import ConfigError
from megarl.config import Config
from megarl.config_checks.common import check_counts, have_te, uses_critic
from megarl.config_checks.moe import check_experts


def check_model(cfg: Config) -> None:
    check_counts(cfg.model, "model", ["vocab_divisible_by"])  # 0 would divide by zero when padding
    spec = cfg.model.layer_spec
    if spec == "te" and not have_te():
        raise ConfigError("model.layer_spec=te but transformer_engine is not installed; use model.layer_spec=local")
    if cfg.parallel.sequence_parallel and cfg.parallel.tp == 1:  # megatron-core refuses it with a traceback
        raise ConfigError("parallel.sequence_parallel=true needs parallel.tp > 1 (it splits each sequence over the "
                          "TP ranks); set parallel.sequence_parallel=false or raise parallel.tp")


def check_packing(cfg: Config) -> None:
    """Packed (THD) micro-batches need an attention with a THD path (parallel.cp > 1: check_parallel)."""
    keys = ["actor.packing"] * cfg.actor.packing + ["critic.packing"] * (cfg.critic.packing and uses_critic(cfg))
    keys += ["reward.model.packing"] * bool(cfg.reward.model.packing and cfg.reward.model.path)
    if not keys:
        return
    spec = cfg.model.layer_spec
    te = spec == "te" or (spec == "auto" and have_te())
    if not te and cfg.model.attention_backend == "local":
        raise ConfigError(f"{keys[0]}=true needs model.attention_backend=sdpa (megatron's unfused attention has no "
                          f"packed-sequence path); set model.attention_backend=sdpa or {keys[0]}=false")


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
    if p.cp > 1:
        check_ulysses_heads(p, heads // p.tp, kv_heads // p.tp)
    layers = hf.get("num_hidden_layers", 1)
    if layers % p.pp:
        raise ConfigError(f"parallel.pp={p.pp} must divide num_hidden_layers ({layers})")
    check_experts(cfg, world_size, hf)


def check_ulysses_heads(p, heads: int, kv_heads: int) -> None:
    """Ulysses trades tokens for heads: each CP rank attends with heads / cp query heads."""
    if heads % p.cp or (kv_heads % p.cp and p.cp % kv_heads):
        raise ConfigError(f"parallel.cp={p.cp} must divide the query heads per TP rank ({heads}) and divide or "
                          f"be a multiple of the key/value heads per TP rank ({kv_heads}); lower parallel.cp")


def check_context_parallel(cfg: Config) -> None:
    """parallel.cp > 1 runs megarl's Ulysses attention on packed rows (megarl/models/context_parallel.py)."""
    if cfg.parallel.cp == 1:
        return
    roles = [("actor.packing", cfg.actor.packing), ("critic.packing", cfg.critic.packing or not uses_critic(cfg)),
             ("reward.model.packing", cfg.reward.model.packing or not cfg.reward.model.path)]
    off = next((key for key, on in roles if not on), None)
    if off:
        raise ConfigError(f"parallel.cp={cfg.parallel.cp} splits packed rows over the CP ranks; set {off}=true")
    spec = cfg.model.layer_spec
    if spec == "te" or (spec == "auto" and have_te()) or cfg.model.attention_backend != "sdpa":
        raise ConfigError(f"parallel.cp={cfg.parallel.cp} runs megarl's Ulysses SDPA attention; set "
                          "model.layer_spec=local and model.attention_backend=sdpa")
    if cfg.parallel.sequence_parallel:
        raise ConfigError("parallel.cp > 1 with parallel.sequence_parallel=true is not supported; turn one off")


def check_batches(cfg: Config, world_size: int) -> None:
    check_counts(cfg.data, "data", ["batch_size"])
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
    for role in ("actor", "critic") if uses_critic(cfg) else ("actor",):
        micro = getattr(cfg, role).micro_batch_size
        if micro <= 0 or (mini // dp) % micro:
            raise ConfigError(
                f"{role}.micro_batch_size={micro} must divide the per-GPU mini-batch "
                f"(actor.mini_batch_size / dp = {mini // dp})"
            )


def training_world(cfg: Config, world_size: int) -> int:
    """Ranks that train: the world in sync mode, the world less placement.rollout_ranks in async mode."""
    return world_size - cfg.placement.rollout_ranks if cfg.trainer.mode == "async" else world_size


_ASYNC_UNSUPPORTED = (  # (is set, key, why) for trainer.mode=async
    (lambda c: bool(c.trainer.replay_rollouts) or c.trainer.rollout_only, "trainer.replay_rollouts / rollout_only",
     "each half already runs alone"),
)


def check_async(cfg: Config, world_size: int, hf: dict) -> None:
    """trainer.mode=async: at least one rollout and one training rank, a placement inside the world,
    a rollout TP that fits its ranks and the model's heads, the same data-parallel size on both sides."""
    if cfg.trainer.mode != "async":
        return
    pl, a = cfg.placement, cfg.async_
    if world_size < 2:
        raise ConfigError(f"trainer.mode=async needs at least 2 ranks (one rollout, one training), got {world_size}; "
                          f"start more processes (torchrun --nproc_per_node 2) or set trainer.mode=sync")
    if not 1 <= pl.rollout_ranks < world_size:
        raise ConfigError(f"placement.rollout_ranks={pl.rollout_ranks} does not cover the world of {world_size} "
                          f"ranks with both roles; use 1 .. {world_size - 1} (the rest train)")
    for is_set, key, why in _ASYNC_UNSUPPORTED:
        if is_set(cfg):
            raise ConfigError(f"{key} is not supported with trainer.mode=async ({why}); unset it or use "
                              f"trainer.mode=sync")
    if pl.rollout_tp < 1 or pl.rollout_tp > pl.rollout_ranks or pl.rollout_ranks % pl.rollout_tp:
        raise ConfigError(f"placement.rollout_tp={pl.rollout_tp} must divide placement.rollout_ranks="
                          f"{pl.rollout_ranks} (a rollout TP group lives inside the rollout ranks)")
    heads, kv = hf.get("num_attention_heads", 1), hf.get("num_key_value_heads") or hf.get("num_attention_heads", 1)
    if heads % pl.rollout_tp or kv % pl.rollout_tp:
        raise ConfigError(f"placement.rollout_tp={pl.rollout_tp} must divide the attention heads ({heads}) and "
                          f"key/value heads ({kv})")
    # dense data-parallel replicas: parallel.ep folds the same ranks again for the experts, each still its own batch
    train_dp = (world_size - pl.rollout_ranks) // max(1, cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp)
    if pl.rollout_ranks // pl.rollout_tp != train_dp:
        raise ConfigError(f"placement: {pl.rollout_ranks // pl.rollout_tp} rollout replicas (rollout_ranks / "
                          f"rollout_tp) must equal the {train_dp} training data-parallel replicas; change "
                          f"placement.rollout_ranks, placement.rollout_tp or parallel.tp")
    if a.max_staleness < 0 or a.queue_size < 1 or a.bucket_mb <= 0:
        raise ConfigError(f"async.max_staleness={a.max_staleness} must be >= 0, async.queue_size={a.queue_size} "
                          f">= 1 and async.bucket_mb={a.bucket_mb} > 0")
