"""Checks of a mixture-of-experts model: expert parallelism, its rollout engine, router replay."""
from __future__ import annotations

from megarl.errors import ConfigError
from megarl.config import Config
from megarl.config_checks.common import check_counts


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
    if p.cp > 1 and p.tp > 1:  # CP runs without sequence parallelism, which MoE training at TP > 1 needs
        raise ConfigError(f"parallel.cp={p.cp} with parallel.tp={p.tp} on a mixture-of-experts model is not supported "
                          "(megatron-core's MoE layer trains TP only with sequence parallelism, which CP excludes); "
                          "use parallel.tp=1 and spread the experts with parallel.ep")
    if p.tp > 1 and not p.sequence_parallel:  # megatron-core's MoELayer refuses to train so
        raise ConfigError(f"parallel.tp={p.tp} with a mixture-of-experts model needs parallel.sequence_parallel=true "
                          "(megatron-core's MoE layer trains TP only with it); "
                          "or use parallel.tp=1 and spread the experts with parallel.ep")


def check_moe_rollout(cfg: Config, hf: dict) -> None:
    """The native engine generates with a mixture of experts wherever the expert-tensor ranks hold the same
    rows, i.e. parallel.etp divides parallel.tp (megarl/rollout/moe_step.py: experts over parallel.ep, their
    FFN split over etp, partial sums all-reduced); SGLang's weight stream sends every expert (gathered over EP)."""
    if moe_experts(hf) is None:
        return
    if cfg.trainer.mode == "async":  # the rollout ranks' own copy generates: EP 1, expert-TP = placement.rollout_tp
        return
    p = cfg.parallel
    etp = p.tp if p.etp is None else p.etp
    if cfg.rollout.engine == "native" and p.tp % etp:
        raise ConfigError(f"rollout.engine=native generates with the mixture-of-experts model {cfg.model.path} when "
                          f"parallel.etp divides parallel.tp (etp={etp}, tp={p.tp}); leave parallel.etp unset (= tp) "
                          "or set it to a divisor of parallel.tp")


def check_router_replay(cfg: Config, hf: dict) -> None:
    """actor.router_replay=r3 replays what the rollout engine recorded (the native engine, or SGLang's
    routed-experts capture: megarl/rollout/sglang.py), also over multi-turn and HTTP agent conversations and
    responses resumed across steps (megarl/rollout/expert_record.py merges their calls), at any TP layout
    check_experts accepts (sequence parallelism: each TP rank replays its slice of the ids)."""
    a = cfg.actor
    check_counts(a, "actor", ["router_replay_probe_every"], low=0)
    if a.router_replay == "none":
        return
    if moe_experts(hf) is None:
        raise ConfigError(f"actor.router_replay={a.router_replay} needs a mixture-of-experts model; {cfg.model.path} "
                          "is dense: set actor.router_replay=none")
