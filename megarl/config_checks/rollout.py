"""Checks of the rollout section: sampling, stop tokens, partial rollouts, SGLang, multi-turn, agent server."""
from __future__ import annotations

from megarl.errors import ConfigError
from megarl.config import Config, RolloutConfig
from megarl.config_checks.common import GROUP_ADVANTAGES, check_counts, check_numbers


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
    if cfg.trainer.mode == "async":  # SGLang runs on the rollout ranks (placement.rollout_tp, PP 1, CP 1)
        return
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
    check_counts(s, "rollout.server", ["port", "agent_processes"], low=0)
    check_numbers(s, "rollout.server", ["timeout_s"], low=0, strict=True)
