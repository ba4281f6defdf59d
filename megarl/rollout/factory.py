"""The rollout engine a run asks for (``rollout.engine``), wrapped for multi-turn when enabled."""
from __future__ import annotations

from dataclasses import replace

from megarl.errors import ConfigError
from megarl.config import Config
from megarl.rollout.engine import RolloutEngine
from megarl.rollout.native import EngineOptions, NativeEngine


def records_experts(cfg: Config) -> bool:
    """Whether the engine returns each token's expert ids: ``rollout.record_experts``, or
    ``actor.router_replay=r3``, which replays them."""
    return cfg.rollout.record_experts or cfg.actor.router_replay == "r3"


def engine_options(cfg: Config) -> EngineOptions:
    """The native engine's options: ``rollout.*``, graphs sized for the longest prompt + response; expert
    ids recorded also when ``actor.router_replay=r3`` replays them."""
    options = EngineOptions.from_config(cfg.rollout, max_model_len=cfg.data.max_prompt_len + cfg.rollout.max_new_tokens)
    return replace(options, record_experts=records_experts(cfg))


def engine_title(cfg: Config) -> str:
    """What starts, for the start-up line; says when SGLang samples in another dtype than the actor trains in."""
    r = cfg.rollout
    dtype = (f"it samples in rollout.sglang.dtype={r.sglang.dtype}, the actor trains in model.dtype={cfg.model.dtype}; "
             "algorithm.rollout_correction.preset=sglang corrects for it")
    if r.engine == "sglang" and cfg.trainer.mode == "async":  # what the training ranks start
        return "the native engine for evaluation (the rollout ranks run SGLang" + \
            (f": {dtype})" if r.sglang.dtype != cfg.model.dtype else ")")
    if r.engine == "sglang" and r.sglang.dtype != cfg.model.dtype:
        return f"the sglang rollout engine ({dtype})"
    return f"the {r.engine} rollout engine"


def training_engine_config(cfg: Config) -> Config:
    """The config of the training ranks' engine. trainer.mode=async: it only evaluates, so it is the native
    engine on the actor's own weights (no second copy, no SGLang on the training GPUs) whatever
    ``rollout.engine`` the rollout ranks run."""
    if cfg.trainer.mode == "sync" or cfg.rollout.engine == "native":
        return cfg
    return replace(cfg, rollout=replace(cfg.rollout, engine="native"))


def build_engine(cfg: Config, actor, groups, tokenizer, stop_ids: list[int], pad_id: int) -> RolloutEngine:
    """``rollout.engine`` on the actor's weights; an :class:`~megarl.rollout.agent.AgentLoop` over it
    when ``rollout.multi_turn.enable``."""
    return wrap_engine(cfg, base_engine(cfg, actor, groups, stop_ids, pad_id), tokenizer, groups, stop_ids, pad_id)


def base_engine(cfg: Config, actor, groups, stop_ids: list[int], pad_id: int) -> RolloutEngine:
    """``rollout.engine`` itself (no agent loop or server around it); SGLang with ``actor.module`` None
    takes its weights through ``load_weights`` (the async rollout ranks)."""
    if cfg.rollout.engine == "native":
        return NativeEngine(actor.module, groups, actor.info.vocab_size, stop_ids, pad_id, engine_options(cfg))
    return _sglang(cfg, actor, groups, stop_ids, pad_id)


def wrap_engine(cfg: Config, engine: RolloutEngine, tokenizer, groups, stop_ids: list[int],
                pad_id: int) -> RolloutEngine:
    """``engine`` behind the agent server (``rollout.server``) or the multi-turn loop, when enabled."""
    if cfg.rollout.server.enable:
        return _server(cfg, engine, tokenizer, stop_ids, pad_id)
    return _agent(cfg, engine, tokenizer, groups) if cfg.rollout.multi_turn.enable else engine


def _server(cfg: Config, engine: RolloutEngine, tokenizer, stop_ids: list[int], pad_id: int) -> RolloutEngine:
    from megarl.algos.registry import load_dotted
    from megarl.rollout.http_agents import HttpAgentRollout
    from megarl.rollout.turns import single_token_id
    from megarl.tools import resolve_parser

    s = cfg.rollout.server
    key = "agent" if s.agent else "environment"
    try:
        agent = load_dotted(getattr(s, key))
    except (ValueError, ImportError, AttributeError) as e:
        raise ConfigError(f"rollout.server.{key}: {e}") from None
    if key == "environment":
        from functools import partial

        from megarl.agents.environment import run_episode

        agent = partial(run_episode, agent, max_turns=s.max_turns, model=s.model_name)
    ends = [single_token_id(tokenizer, s.tool_call_end, "rollout.server.tool_call_end")] if s.tool_call_end else []
    return HttpAgentRollout(engine, tokenizer, agent, resolve_parser(s.parser), stop_ids, pad_id, host=s.host,
                            port=s.port, workers=s.workers, timeout_s=s.timeout_s, model_name=s.model_name,
                            max_len=engine_options(cfg).max_model_len, stop_ids=ends, agent_processes=s.agent_processes)


def _sglang(cfg: Config, actor, groups, stop_ids: list[int], pad_id: int) -> RolloutEngine:
    from megarl.rollout.sglang import SGLangEngine, SGLangOptions

    s = cfg.rollout.sglang
    options = SGLangOptions(
        model_path=cfg.model.path, mem_fraction_static=s.mem_fraction_static, dtype=s.dtype,
        seed=cfg.rollout.seed, deterministic=s.deterministic, enable_memory_saver=s.enable_memory_saver,
        weights_cpu_backup=s.weights_cpu_backup, max_running_requests=s.max_running_requests,
        update_bucket_mb=s.update_bucket_mb, start_timeout_s=s.start_timeout_s,
        record_experts=records_experts(cfg) and actor.info.moe is not None)  # a dense model has no experts
    return SGLangEngine(actor.module, groups, actor.info, stop_ids, options)  # SGLang needs no pad id


def _agent(cfg: Config, engine: RolloutEngine, tokenizer, groups) -> RolloutEngine:
    from megarl.rollout.agent import AgentLoop, AgentOptions
    from megarl.rollout.turns import single_token_id
    from megarl.tools import ToolExecutor, resolve_parser, resolve_tools

    m = cfg.rollout.multi_turn
    end = single_token_id(tokenizer, m.tool_call_end, "rollout.multi_turn.tool_call_end")
    options = AgentOptions(tool_call_end=end, max_turns=m.max_turns, max_tool_output_tokens=m.max_tool_output_tokens,
                           overlap_tools=m.overlap_tools, max_prompt_len=cfg.data.max_prompt_len)
    parser = resolve_parser(m.parser)
    if m.environment:
        return AgentLoop(engine, tokenizer, None, parser, options, groups,
                         environment=_environment(m, tokenizer, parser))
    executor = ToolExecutor(resolve_tools(list(m.tools)), max_workers=m.tool_workers, timeout_s=m.tool_timeout_s)
    return AgentLoop(engine, tokenizer, executor, parser, options, groups, interaction=_interaction(m.interaction))


def _environment(m, tokenizer, parser):
    from megarl.algos.registry import load_dotted
    from megarl.rollout.environments import EnvironmentRunner

    try:
        make_env = load_dotted(m.environment)
    except ValueError as e:
        raise ConfigError(f"rollout.multi_turn.environment: {e}") from None
    return EnvironmentRunner(make_env, tokenizer, parser, workers=m.tool_workers, timeout_s=m.tool_timeout_s)


def _interaction(spec: str):
    if not spec:
        return None
    from megarl.algos.registry import load_dotted

    try:
        return load_dotted(spec)
    except ValueError as e:
        raise ConfigError(f"rollout.multi_turn.interaction: {e}") from None
