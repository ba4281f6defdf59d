"""Cross-field checks of a :class:`megarl.config.Config`, one short function per section.

Each failure is a :class:`ConfigError` that names the key and the fix.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path

from megarl.errors import ConfigError
from megarl.config import LORA_TARGETS, REDIS_URL, Config, DapoConfig, RolloutConfig, RolloutCorrectionConfig
from megarl.algos.advantages import get_advantage
from megarl.algos.rollout_correction import from_section as correction_from_section, keys_read
from megarl.algos.losses import get_policy_loss
from megarl.algos.registry import load_dotted
from megarl.data.tokenizer import check_tokenizer_dir, check_vocab_fits
from megarl.models.hub import resolve_hub_models
from megarl.rewards.registry import get_reward

GROUP_ADVANTAGES = {"grpo", "rloo", "reinforce_pp_baseline"}
SCORE_ONLY_ADVANTAGES = {"grpo", "rloo"}  # advantages from sequence scores alone (no token rewards)


def read_hf_config(path: str, key: str = "model.path") -> dict:
    """config.json of a Hugging Face directory, or a ConfigError naming ``key``."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"{key}: '{path}' has no config.json; point it at a Hugging Face model directory")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{cfg_file}:{e.lineno}: invalid JSON ({e.msg})") from None


def check_numbers(obj, prefix: str, keys, low: float | None = None, strict: bool = False) -> None:
    """Each ``obj.<key>`` must be finite and, with ``low``, >= low (> low when ``strict``)."""
    for key in keys:
        value = getattr(obj, key)
        bad = not math.isfinite(value) or (low is not None and (value < low or (strict and value == low)))
        if bad:
            bound = "" if low is None else f" {'>' if strict else '>='} {low:g}"
            raise ConfigError(f"{prefix}.{key}={value} must be a finite number{bound}")


def check_counts(obj, prefix: str, keys, low: int = 1) -> None:
    """Each integer ``obj.<key>`` must be >= low."""
    for key in keys:
        if getattr(obj, key) < low:
            raise ConfigError(f"{prefix}.{key}={getattr(obj, key)} must be >= {low}")


def have_te() -> bool:
    """transformer_engine is importable (megarl.models.builder.have_te, without importing megatron)."""
    return importlib.util.find_spec("transformer_engine") is not None


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


def check_model(cfg: Config) -> None:
    check_counts(cfg.model, "model", ["vocab_divisible_by"])  # 0 would divide by zero when padding
    spec = cfg.model.layer_spec
    if spec == "te" and not have_te():
        raise ConfigError("model.layer_spec=te but transformer_engine is not installed; use model.layer_spec=local")
    if cfg.parallel.sequence_parallel and not (spec == "te" or (spec == "auto" and have_te())):
        raise ConfigError(
            f"parallel.sequence_parallel=true needs the transformer-engine layer spec (model.layer_spec={spec}, "
            f"transformer_engine {'installed' if have_te() else 'not installed'}); set parallel.sequence_parallel=false"
        )


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


def moe_experts(hf: dict) -> int | None:
    """The expert count of a mixture-of-experts config.json (None for a dense model)."""
    from megarl.models.hf_config import FAMILIES

    arch = (hf.get("architectures") or [""])[0]
    family = next((f for f in FAMILIES if arch in (f + "ForCausalLM", f + "ForSequenceClassification")), None)
    moe = FAMILIES[family].moe if family else None
    return next((hf[k] for k in moe.experts_keys if k in hf), None) if moe else None


def check_experts(cfg: Config, world_size: int, hf: dict) -> None:
    """parallel.ep / parallel.etp fit the model's experts and the ranks of a pipeline stage."""
    p = cfg.parallel
    etp = p.tp if p.etp is None else p.etp
    if p.ep < 1 or etp < 1:
        raise ConfigError(f"parallel.ep={p.ep} and parallel.etp={p.etp} must be >= 1")
    experts = moe_experts(hf)
    if experts is None:
        if p.ep > 1 or p.etp not in (None, p.tp):
            raise ConfigError(f"parallel.ep={p.ep} / parallel.etp={p.etp} need a mixture-of-experts model; "
                              f"{cfg.model.path} is dense: set parallel.ep=1 and leave parallel.etp unset")
        if cfg.actor.lora.rank > 0 and cfg.actor.lora.experts:
            raise ConfigError(f"actor.lora.experts=true needs a mixture-of-experts model; {cfg.model.path} is dense: "
                              "set actor.lora.experts=false")
        return
    if experts % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} must divide the model's {experts} experts; use a divisor of {experts}")
    stage = world_size // p.pp
    if stage % (p.ep * etp):
        raise ConfigError(f"parallel.ep={p.ep} x parallel.etp={etp} must divide the {stage} ranks of a pipeline stage "
                          f"(world size {world_size} / parallel.pp={p.pp}); change them or the number of processes")
    lo = cfg.actor.lora
    if lo.rank > 0 and lo.experts and not {"linear_fc1", "linear_fc2"} & set(lo.targets):
        raise ConfigError(f"actor.lora.experts=true adapts the experts' linear_fc1 / linear_fc2, which "
                          f"actor.lora.targets={lo.targets} leaves out; add them or set actor.lora.experts=false")
    if cfg.parallel.cp > 1:
        raise ConfigError(f"parallel.cp={cfg.parallel.cp} with a mixture-of-experts model is not supported yet; "
                          "set parallel.cp=1")
    if p.tp > 1 and not p.sequence_parallel:  # megatron-core's MoELayer refuses to train so
        raise ConfigError(f"parallel.tp={p.tp} with a mixture-of-experts model needs parallel.sequence_parallel=true "
                          "(megatron-core's MoE layer trains TP only with it; it needs transformer-engine); "
                          "or use parallel.tp=1 and spread the experts with parallel.ep")


def check_moe_rollout(cfg: Config, hf: dict) -> None:
    """The native engine generates with a mixture of experts at parallel.tp=1 (experts over parallel.ep,
    megarl/rollout/moe_step.py); SGLang's weight stream sends every expert (gathered over EP)."""
    if moe_experts(hf) is None:
        return
    if cfg.rollout.engine == "native" and cfg.parallel.tp > 1:
        raise ConfigError(f"rollout.engine=native generates with the mixture-of-experts model {cfg.model.path} at "
                          f"parallel.tp=1 only (parallel.tp={cfg.parallel.tp}); set parallel.tp=1 and spread the "
                          "experts with parallel.ep")


def check_router_replay(cfg: Config, hf: dict) -> None:
    """actor.router_replay=r3 replays what the native engine recorded (check_moe_rollout: an MoE model
    generates there only) for single-turn responses generated in one step: the agent loops append
    tokens no router chose, and partial rollouts resume responses without their earlier ids."""
    a = cfg.actor
    check_counts(a, "actor", ["router_replay_probe_every"], low=0)
    if a.router_replay == "none":
        return
    if moe_experts(hf) is None:
        raise ConfigError(f"actor.router_replay={a.router_replay} needs a mixture-of-experts model; {cfg.model.path} "
                          "is dense: set actor.router_replay=none")
    for key, on, why in (("rollout.multi_turn.enable", cfg.rollout.multi_turn.enable, "appended tool and user tokens"),
                         ("rollout.server.enable", cfg.rollout.server.enable, "appended tool and user tokens"),
                         ("rollout.partial", cfg.rollout.partial, "responses resumed across steps")):
        if on:
            raise ConfigError(f"actor.router_replay={a.router_replay} with {key}=true is not supported ({why} have "
                              "no recorded experts); set one of them off")


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


def check_rollout(cfg: Config) -> None:
    r = cfg.rollout
    check_counts(r, "rollout", ["n", "max_new_tokens", "max_batch", "max_num_batched_tokens"])
    check_numbers(r, "rollout", ["temperature"], low=0)
    if not 0 < r.top_p <= 1:  # NaN fails too
        raise ConfigError(f"rollout.top_p={r.top_p} must be in (0, 1]")
    if r.top_k == 0 or r.top_k < -1:
        raise ConfigError(f"rollout.top_k={r.top_k} keeps no token; use a count >= 1, or -1 to turn top-k off")
    if r.page_size not in (8, 16, 32, 64, 128):
        raise ConfigError(f"rollout.page_size={r.page_size} must be a power of two in 8..128")
    if r.kv_cache_gb < 0 or not 0 < r.kv_cache_fraction <= 1:
        raise ConfigError("rollout.kv_cache_gb must be >= 0 and rollout.kv_cache_fraction in (0, 1]")
    if cfg.algorithm.advantage in GROUP_ADVANTAGES and r.n < 2:
        raise ConfigError(
            f"algorithm.advantage={cfg.algorithm.advantage} compares samples of one prompt; set rollout.n >= 2"
        )


def check_stop_tokens(cfg: Config, hf: dict) -> None:
    """Each rollout.stop_token_ids entry is a token id of the model (0 <= id < vocab_size)."""
    vocab = hf.get("vocab_size")
    if not isinstance(vocab, int):
        return
    bad = [i for i in cfg.rollout.stop_token_ids if not 0 <= i < vocab]
    if bad:
        raise ConfigError(f"rollout.stop_token_ids: {bad} outside the vocabulary of {cfg.model.path} (ids 0.."
                          f"{vocab - 1}); list token ids of the model's tokenizer")


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
    if cfg.rollout.engine == "sglang":
        raise ConfigError("actor.lora with rollout.engine=sglang is not supported yet (its weight stream sends "
                          "plain weights); use rollout.engine=native")


def check_critic(cfg: Config) -> None:
    if uses_critic(cfg):  # an unused critic's knobs are not checked
        check_optim(cfg.critic.optim, "critic.optim")
        check_cpu_offload(cfg, cfg.critic.optim, "critic.optim")
        check_counts(cfg.critic, "critic", ["ppo_epochs"])
        check_counts(cfg.critic, "critic", ["forward_micro_batch_size"], low=0)


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
            raise ConfigError(f"reward.terms[{i}].name={t.name!r}: {_one_line(e)}") from None
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
            raise ConfigError(f"{key}={value!r}: {_one_line(e)}") from None
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


def check_partial(cfg: Config) -> None:
    """rollout.partial: the native engine's early stop, one single-turn generation per step."""
    r = cfg.rollout
    if not r.partial:
        if r.partial_batches != RolloutConfig().partial_batches:
            raise ConfigError("rollout.partial_batches is read only with rollout.partial=true; set it or drop "
                              "partial_batches")
        return
    if r.partial_batches < 2:
        raise ConfigError(f"rollout.partial_batches={r.partial_batches} must be >= 2: a step trains one batch, so "
                          "with one in flight nothing is left to carry over (rollout.partial=false does that)")
    clash = [(r.engine == "sglang", "rollout.engine=sglang (only the native engine stops a generation and resumes "
                                    "its requests)"),
             (r.multi_turn.enable, "rollout.multi_turn.enable=true (a conversation cannot be resumed mid-turn)"),
             (r.server.enable, "rollout.server.enable=true (agents drive their own requests)"),
             (cfg.algorithm.dapo.dynamic_sampling, "algorithm.dapo.dynamic_sampling=true (both decide which "
                                                   "groups fill the batch)"),
             (cfg.algorithm.advantage == "remax", "algorithm.advantage=remax (its greedy baseline is generated "
                                                  "per step)"),
             (bool(cfg.trainer.replay_rollouts), "trainer.replay_rollouts (replayed batches are not generated)")]
    why = next((text for bad, text in clash if bad), None)
    if why:
        raise ConfigError(f"rollout.partial=true does not work with {why}; or set rollout.partial=false")


def check_sglang(cfg: Config) -> None:
    s = cfg.rollout.sglang
    if cfg.rollout.engine != "sglang":
        return
    if not 0 < s.mem_fraction_static < 1:
        raise ConfigError(f"rollout.sglang.mem_fraction_static={s.mem_fraction_static} must be in (0, 1)")
    check_numbers(s, "rollout.sglang", ["update_bucket_mb", "start_timeout_s"], low=0, strict=True)
    check_counts(s, "rollout.sglang", ["max_running_requests"], low=0)
    if cfg.parallel.pp > 1:
        raise ConfigError(f"rollout.engine=sglang needs parallel.pp=1 (got {cfg.parallel.pp}); use rollout.engine=native")
    if cfg.parallel.cp > 1:
        raise ConfigError(f"rollout.engine=sglang needs parallel.cp=1 (got {cfg.parallel.cp}: each CP rank would "
                          "sample its own responses for the same rows); use rollout.engine=native")


def check_multi_turn(cfg: Config) -> None:
    m = cfg.rollout.multi_turn
    if not m.enable:
        return
    check_counts(m, "rollout.multi_turn", ["max_turns", "max_tool_output_tokens", "tool_workers"])
    check_numbers(m, "rollout.multi_turn", ["tool_timeout_s"], low=0, strict=True)
    if m.environment:
        check_environment(m)
    elif not m.tools:
        raise ConfigError("rollout.multi_turn.tools=[]: a multi-turn rollout needs at least one tool")
    dup = next((t for i, t in enumerate(m.tools) if t in m.tools[:i]), None)
    if dup is not None:
        raise ConfigError(f"rollout.multi_turn.tools lists '{dup}' twice")
    if cfg.rollout.ignore_eos:
        raise ConfigError("rollout.ignore_eos=true with rollout.multi_turn.enable=true: a turn would never end; "
                          "turn one of them off")
    if m.overlap_tools and cfg.rollout.engine != "native":
        raise ConfigError(f"rollout.multi_turn.overlap_tools=true needs rollout.engine=native (the "
                          f"{cfg.rollout.engine} adapter runs one batch per call); "
                          "set rollout.multi_turn.overlap_tools=false")


def check_environment(m) -> None:
    """rollout.multi_turn.environment answers every turn: tools and a simulated user would never run."""
    if ":" not in m.environment:
        raise ConfigError(f"rollout.multi_turn.environment={m.environment!r} must be module:function")
    if m.interaction:
        raise ConfigError("rollout.multi_turn.environment and rollout.multi_turn.interaction are both set: the "
                          "environment answers every turn; keep one")
    if m.tools not in ([], ["calculator"]):  # the default list stays harmless
        raise ConfigError(f"rollout.multi_turn.tools={m.tools} with rollout.multi_turn.environment: the environment "
                          "runs the tool calls it receives itself; leave rollout.multi_turn.tools unset")


def check_server(cfg: Config) -> None:
    s = cfg.rollout.server
    if not s.enable:
        return
    if bool(s.agent) == bool(s.environment):
        raise ConfigError("rollout.server: set exactly one of agent (module:function(sample, base_url)) and "
                          "environment (module:Name with reset/step)")
    spec = s.agent or s.environment
    if ":" not in spec:
        raise ConfigError(f"rollout.server: {spec!r} must be module:name")
    if cfg.rollout.multi_turn.enable:
        raise ConfigError("rollout.server.enable=true with rollout.multi_turn.enable=true: the agent runs its own "
                          "turns; turn rollout.multi_turn.enable off")
    if cfg.rollout.engine != "native":
        raise ConfigError(f"rollout.server needs rollout.engine=native (got {cfg.rollout.engine})")
    if cfg.parallel.tp > 1 or cfg.parallel.pp > 1:
        raise ConfigError("rollout.server needs parallel.tp=1 and parallel.pp=1 (one process serves its samples)")
    if cfg.rollout.ignore_eos:
        raise ConfigError("rollout.ignore_eos=true with rollout.server.enable=true: a turn would never end")
    check_counts(s, "rollout.server", ["workers", "max_turns"])
    check_counts(s, "rollout.server", ["port"], low=0)
    check_numbers(s, "rollout.server", ["timeout_s"], low=0, strict=True)


def _one_line(e: Exception) -> str:
    return " ".join(str(e.args[0] if e.args else e).split())


def check_output_dir(key: str, path: str) -> None:
    """``path`` is, or can be created as, a directory this process may write to."""
    if not path.strip():
        raise ConfigError(f"{key} is empty; name a directory, e.g. {key}=runs/my_run")
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{key}: '{out}' is a file, not a directory; pick another directory")
    parent = next((p for p in [out, *out.parents] if p.exists() or p.is_symlink()), None)
    if parent is not None and not parent.is_dir():
        raise ConfigError(f"{key}: '{out}' cannot be created: '{parent}' is not a directory; pick another path")
    if parent is not None and not os.access(parent, os.W_OK):
        raise ConfigError(f"{key}: '{parent}' is not writable; pick a directory you can write to")


def check_paths(cfg: Config) -> None:
    check_output_dir("trainer.run_dir", cfg.trainer.run_dir)
    if cfg.trainer.dump_rollouts:
        check_output_dir("trainer.dump_rollouts", cfg.trainer.dump_rollouts)
    replay = cfg.trainer.replay_rollouts
    if replay and (not Path(replay).is_dir() or not any(Path(replay).glob("step_*_dp*.pt"))):
        raise ConfigError(f"trainer.replay_rollouts: '{replay}' holds no dumped rollouts (step_*_dp*.pt); "
                          f"dump them first with trainer.rollout_only=true trainer.dump_rollouts={replay}")
    if not cfg.data.train_mix and not data_source_found(cfg.data.train_path):
        raise ConfigError(f"data.train_path: '{cfg.data.train_path}' not found")
    if cfg.data.eval_path and not data_source_found(cfg.data.eval_path):
        raise ConfigError(f"data.eval_path: '{cfg.data.eval_path}' not found; unset it to skip evaluation")
    for key, path in (("critic.path", cfg.critic.path), ("ref.path", cfg.ref.path),
                      ("reward.model.path", cfg.reward.model.path)):
        if path:
            read_hf_config(path, key)


def data_source_found(path: str) -> bool:
    """A file, a saved dataset, or a name the hub may hold (checked when it is read)."""
    from megarl.data.sources import source_kind
    from megarl.errors import DataError

    try:
        source_kind(path)
    except DataError:
        return False
    return True


def check_data(cfg: Config) -> None:
    """data.train_mix and data.eval_sets entries: paths, weights, names, samples, pass@k, metric."""
    d = cfg.data
    maps = [("data.row_map", d.row_map)] + [(f"data.train_mix[{i}].row_map", s.row_map)
                                            for i, s in enumerate(d.train_mix)]
    for key, path in maps + [(f"data.eval_sets[{i}].row_map", s.row_map) for i, s in enumerate(d.eval_sets)]:
        if path:
            try:
                load_dotted(path)  # imports module:function the way the loader will
            except ValueError as e:
                raise ConfigError(f"{key}={path!r}: {_one_line(e)}") from None
    for i, s in enumerate(d.train_mix):
        if not data_source_found(s.path):
            raise ConfigError(f"data.train_mix[{i}].path: '{s.path}' not found")
        check_numbers(s, f"data.train_mix[{i}]", ["weight"], low=0, strict=True)
    names = [s.name for s in d.eval_sets]
    for i, s in enumerate(d.eval_sets):
        key = f"data.eval_sets[{i}]"
        if not s.name or "/" in s.name or s.name in names[:i]:
            raise ConfigError(f"{key}.name={s.name!r}: give each eval set its own name without '/'")
        if not data_source_found(s.path):
            raise ConfigError(f"{key}.path: '{s.path}' not found")
        check_counts(s, key, ["n"])
        check_counts(s, key, ["limit", "max_new_tokens"], low=0)
        if s.max_new_tokens > cfg.rollout.max_new_tokens:
            raise ConfigError(f"{key}.max_new_tokens={s.max_new_tokens} exceeds rollout.max_new_tokens="
                              f"{cfg.rollout.max_new_tokens}, which sizes the model's sequences; raise "
                              "rollout.max_new_tokens or lower the eval set's")
        check_numbers(s, key, ["temperature", "pass_threshold"], low=0)
        if s.temperature == 0 and s.n > 1:
            raise ConfigError(f"{key}: n={s.n} with temperature=0 gives {s.n} equal greedy samples; set "
                              f"{key}.temperature (e.g. 0.6) or n=1")
        if not 0 < s.top_p <= 1:
            raise ConfigError(f"{key}.top_p={s.top_p} must be in (0, 1]")
        bad = [k for k in s.k if not 1 <= k <= s.n]
        if bad:
            raise ConfigError(f"{key}.k={s.k}: each k must be in 1..n={s.n}; raise n or drop {bad}")
        try:
            get_reward(s.metric)
        except (KeyError, ValueError) as e:
            raise ConfigError(f"{key}.metric={s.metric!r}: {_one_line(e)}") from None


def check_model_inputs(cfg: Config, hf: dict, length_key: str, length: int, room: int) -> None:
    """The tokenizer directory holds a vocabulary whose ids the model's embedding covers, and
    ``length`` (config key ``length_key``) leaves ``room`` of the model's positions free."""
    key, path = ("model.tokenizer", cfg.model.tokenizer) if cfg.model.tokenizer else ("model.path", cfg.model.path)
    check_tokenizer_dir(path, key)
    if isinstance(hf.get("vocab_size"), int):
        check_vocab_fits(path, key, hf["vocab_size"])
    positions = hf.get("max_position_embeddings")
    if isinstance(positions, int) and length + room > positions:
        need = f"{length} + {room} prompt token" if room else str(length)
        raise ConfigError(f"{length_key}={length}: {need} exceed the {positions} positions of the model "
                          f"(max_position_embeddings in {cfg.model.path}/config.json); lower {length_key}")


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


def check_sft_data(s) -> None:
    """sft.train_path or sft.train_mix: sources found, weights > 0, columns named, row maps importable."""
    if not s.train_mix and not data_source_found(s.train_path):
        raise ConfigError(f"sft.train_path: '{s.train_path}' not found; name a .jsonl / .json / .parquet file, "
                          "a datasets save_to_disk directory or a hub dataset")
    for i, e in enumerate(s.train_mix):
        if not data_source_found(e.path):
            raise ConfigError(f"sft.train_mix[{i}].path: '{e.path}' not found")
        check_numbers(e, f"sft.train_mix[{i}]", ["weight"], low=0, strict=True)
    sources = [("sft", s)] + [(f"sft.train_mix[{i}]", e) for i, e in enumerate(s.train_mix)]
    for key, src in sources:
        for name in ("prompt_key", "response_key"):
            if getattr(src, name) == "":
                raise ConfigError(f"{key}.{name} is empty; name the column (e.g. {key}.{name}=question)")
        if src.row_map:
            try:
                load_dotted(src.row_map)  # imports module:function the way the loader will
            except ValueError as e:
                raise ConfigError(f"{key}.row_map={src.row_map!r}: {_one_line(e)}") from None


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


def training_world(cfg: Config, world_size: int) -> int:
    """Ranks that train: the world in sync mode, the world less placement.rollout_ranks in async mode."""
    return world_size - cfg.placement.rollout_ranks if cfg.trainer.mode == "async" else world_size


_ASYNC_UNSUPPORTED = (  # (is set, key, why) for trainer.mode=async
    (lambda c: c.parallel.pp > 1, "parallel.pp", "the weight push gathers one pipeline stage"),
    (lambda c: c.parallel.ep > 1, "parallel.ep", "the weight push reshards dense layers only"),
    (lambda c: c.actor.lora.rank > 0, "actor.lora.rank", "the weight push sends full weights"),
    (lambda c: c.rollout.engine != "native", "rollout.engine", "the rollout ranks run the native engine"),
    (lambda c: bool(c.reward.model.path), "reward.model.path", "rollout ranks score with rule rewards"),
    (lambda c: c.algorithm.dapo.dynamic_sampling, "algorithm.dapo.dynamic_sampling", "one batch per step"),
    (lambda c: c.algorithm.advantage == "remax", "algorithm.advantage=remax", "no greedy baseline pass"),
    (lambda c: c.rollout.partial, "rollout.partial", "the rollout ranks generate whole batches"),
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
    train_dp = (world_size - pl.rollout_ranks) // max(1, cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp)
    if pl.rollout_ranks // pl.rollout_tp != train_dp:
        raise ConfigError(f"placement: {pl.rollout_ranks // pl.rollout_tp} rollout replicas (rollout_ranks / "
                          f"rollout_tp) must equal the {train_dp} training data-parallel replicas; change "
                          f"placement.rollout_ranks, placement.rollout_tp or parallel.tp")
    if a.max_staleness < 0 or a.queue_size < 1 or a.bucket_mb <= 0:
        raise ConfigError(f"async.max_staleness={a.max_staleness} must be >= 0, async.queue_size={a.queue_size} "
                          f">= 1 and async.bucket_mb={a.bucket_mb} > 0")


def uses_critic(cfg: Config) -> bool:
    """critic.enable, defaulting to "the advantage estimator needs values"."""
    return cfg.critic.enable if cfg.critic.enable is not None else cfg.algorithm.advantage == "gae"


def uses_ref(cfg: Config) -> bool:
    """ref.enable, defaulting to "some KL term is on"."""
    if cfg.ref.enable is not None:
        return cfg.ref.enable
    return cfg.algorithm.kl_in_reward or cfg.actor.kl_loss_coef > 0
