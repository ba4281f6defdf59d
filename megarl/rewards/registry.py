"""Registry of per-sample reward functions.

A reward function is a registered name or a dotted path 'pkg.module:function'
to a function of this signature:

    fn(prompt: str, response: str, ground_truth: str | None, extra: dict, **kwargs) -> float

`extra` holds the sample's other dataset fields; `kwargs` are the term's
configured keyword arguments. Raising, or returning NaN/inf/a non-number,
marks the sample as failed (CompositeReward gives it the term's fallback).
"""
from __future__ import annotations

from typing import Any, Callable

from megarl.algos.registry import Registry
from megarl.rewards.math_answer import math_answer_reward
from megarl.rewards.rules import DEFAULT_FORMAT_PATTERN, format_reward

RewardFn = Callable[..., float]
REWARDS: Registry[RewardFn] = Registry("reward function")
register_reward = REWARDS.register


def get_reward(name_or_path: str) -> RewardFn:
    """A registered reward name, or a dotted path 'pkg.module:function' to
    `fn(prompt: str, response: str, ground_truth: str | None, extra: dict, **kwargs) -> float`."""
    return REWARDS.get(name_or_path)


@register_reward("format")
def format_term(
    prompt: str, response: str, ground_truth: str | None, extra: dict[str, Any],
    pattern: str | list[str] = DEFAULT_FORMAT_PATTERN,
) -> float:
    """format_reward(response, pattern): 0/1, or partial credit over a list of patterns."""
    return format_reward(response, pattern)


@register_reward("math")
def math_term(
    prompt: str, response: str, ground_truth: str | None, extra: dict[str, Any], strategy: str = "auto"
) -> float:
    """math_answer_reward(response, ground_truth, strategy); a missing ground truth is an error."""
    if ground_truth is None:
        raise ValueError("reward 'math' needs a ground_truth for every sample")
    return math_answer_reward(response, ground_truth, strategy)


@register_reward("agent")
def agent_term(prompt: str, response: str, ground_truth: str | None, extra: dict[str, Any]) -> float:
    """What the sample's agent or environment returned (rollout.server, rollout.multi_turn.environment);
    0 for a failed or silent one."""
    if "agent_failed" not in extra:
        raise ValueError("reward 'agent' reads what rollout.server's agents or rollout.multi_turn.environment's "
                         "environments return; enable one of them")
    return float(extra.get("agent_reward") or 0.0)
