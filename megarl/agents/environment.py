"""Gym-style environments driven through the OpenAI endpoint (``rollout.server.environment``).

An environment is a class (or factory) ``module:Name`` built once per sample, with

    reset(sample: dict) -> list[dict]                       # the opening messages
    step(messages: list[dict]) -> (observation: list[dict], reward: float, done: bool)

:func:`run_episode` is the agent: it calls the model on the messages so far, appends the assistant
message (OpenAI form, tool calls included), steps the environment with the whole conversation, adds
its reward and appends its observation messages (tool / user turns), until ``done``, the turn limit
(``rollout.server.max_turns``) or the sample's token budget (the endpoint's
``context_length_exceeded``). The rewards summed are the sample's ``agent_reward`` (reward term
``agent``). The endpoint's sessions keep the trained sequence token-in/token-out: sampled ids with
their log-probs (loss mask 1), the observations as the chat template's context ids (loss mask 0).
"""
from __future__ import annotations

from typing import Callable

from openai import BadRequestError, OpenAI

_CLIENT = OpenAI(base_url="http://127.0.0.1/v1", api_key="local", max_retries=0, timeout=300)


def run_episode(make_env: Callable, sample: dict, base_url: str, *, max_turns: int, model: str,
                tools: list | None = None) -> dict:
    """One episode of ``make_env()`` on ``sample``; returns ``{"reward", "turns", "done"}``."""
    client = _CLIENT.with_options(base_url=base_url)
    env = make_env()
    messages = list(env.reset(sample))
    total, done, turns = 0.0, False, 0
    while not done and turns < max_turns:
        kwargs = {"tools": tools} if tools else {}
        try:
            reply = client.chat.completions.create(model=model, messages=messages, **kwargs)
        except BadRequestError as e:
            if e.code == "context_length_exceeded":
                break
            raise
        turns += 1
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        observation, reward, done = env.step(list(messages))
        total += float(reward)
        messages += list(observation)
    return {"reward": total, "turns": turns, "done": bool(done)}
