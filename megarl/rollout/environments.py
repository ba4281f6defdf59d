"""Gym-style environments inside the agent loop (``rollout.multi_turn.environment``).

An environment factory is ``module:function`` (a class works), called with no
arguments once per sample; the object it returns has

    reset(sample: dict) -> list[dict]            # the opening messages (OpenAI form)
    step(messages: list[dict]) -> (observation: list[dict], reward: float, done: bool)

``sample`` holds ``key``, ``prompt_ids``, ``prompt_text`` and, when the trainer
binds its rows, the dataset row's ``messages``, ``answer`` and ``extra``.
``step`` gets the whole conversation so far: the opening messages, then per
turn the assistant message (OpenAI form: the text before a tool call as its
content, the calls the loop's parser finds as ``tool_calls``) and the
observations that followed it. The observation messages (``tool`` or ``user``
turns) are appended as the chat template's context ids (loss mask 0); with
``done`` the episode ends and its observation is dropped.

:class:`EnvironmentRunner` runs them for the agent loop on the replica's first
rank: the samples' resets and steps on a thread pool (many environments at
once), each call bounded by ``timeout_s``. A call that raises, returns
something else than the interface says, or runs past its limit ends its sample
as *failed* (loss mask 0 everywhere, ``agent_failed``), never the rollout.
"""
from __future__ import annotations

import math
import threading
import traceback
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import Callable

from megarl.rollout.http_openai import assistant_message


class EnvironmentFault(Exception):
    """An environment broke its interface (raised, returned the wrong thing, timed out)."""


def one_line(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(e)).strip().splitlines()[-1]


def check_messages(messages, what: str) -> list[dict]:
    """``messages`` as a list of dicts with a string ``role`` and string ``content``, else an error."""
    if not isinstance(messages, (list, tuple)) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content") or "", str)
            for m in messages):
        raise EnvironmentFault(f"{what} must return a list of messages ({{'role': str, 'content': str}}), "
                                f"got {type(messages).__name__}")
    return [{**m, "content": m.get("content") or ""} for m in messages]


class EnvironmentRunner:
    """Environments of one rollout, by request key, on the first rank; see the module docstring."""

    def __init__(self, make_env: Callable, tokenizer, parser, workers: int = 8, timeout_s: float = 10.0):
        self.make_env, self.tokenizer, self.parser, self.timeout_s = make_env, tokenizer, parser, timeout_s
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="megarl-env")
        self.envs: dict[int, object] = {}
        self.conversations: dict[int, list[dict]] = {}  # key -> opening messages + assistant / observations
        self.eos_texts = [t for t in (tokenizer.eos_token,) if t]

    # -- bounded calls -------------------------------------------------------
    def _bounded(self, fn: Callable) -> Future:
        """``fn()`` on the pool; the future fails with a timeout after ``timeout_s`` if it is not done."""
        out: Future = Future()

        def settle(how, value) -> None:
            try:
                how(value)
            except InvalidStateError:  # the other side settled it first
                pass

        def work() -> None:
            try:
                settle(out.set_result, fn())
            except BaseException as e:  # noqa: BLE001 - the sample's failure, read where the future is
                settle(out.set_exception, e)

        timer = threading.Timer(self.timeout_s, lambda: settle(
            out.set_exception, EnvironmentFault(f"timed out after {self.timeout_s:g}s")))
        timer.daemon = True
        timer.start()
        out.add_done_callback(lambda _f: timer.cancel())
        self.pool.submit(work)
        return out

    # -- reset ---------------------------------------------------------------
    def reset_all(self, samples: dict[int, dict]) -> dict[int, list[int] | str]:
        """Per key, a fresh environment reset on its sample: its prompt ids (the opening messages
        under the chat template, with the assistant's opening), or a one-line error."""
        self.envs, self.conversations = {}, {}
        futures = {k: self._bounded(lambda s=s, k=k: self._reset(k, s)) for k, s in samples.items()}
        out: dict[int, list[int] | str] = {}
        for k, f in futures.items():
            try:
                out[k] = f.result()
            except Exception as e:  # noqa: BLE001 - a failed sample
                out[k] = f"reset: {one_line(e)}"
        return out

    def _reset(self, key: int, sample: dict) -> list[int]:
        env = self.make_env()
        messages = check_messages(env.reset(sample), "reset")
        if not messages:
            raise EnvironmentFault("reset returned no messages")
        self.envs[key], self.conversations[key] = env, list(messages)
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    # -- step ----------------------------------------------------------------
    def submit_step(self, key: int, text: str) -> Future:
        """Starts the step of ``key``'s environment on its turn's sampled ``text``; the future holds
        ``(observation messages, reward, done, tool calls in the turn)`` or fails (the sample's failure)."""
        for eos in self.eos_texts:
            text = text.replace(eos, "")
        return self._bounded(lambda: self._step(key, text))

    def _step(self, key: int, text: str) -> tuple[list[dict], float, bool, int]:
        conversation = self.conversations[key]
        message = assistant_message(text, self.parser, f"{key}_{len(conversation)}")
        conversation.append(message)
        got = self.envs[key].step(list(conversation))
        if not isinstance(got, (tuple, list)) or len(got) != 3:
            raise EnvironmentFault(f"step must return (observation messages, reward, done), got {got!r:.80}")
        observation, reward, done = got
        observation = check_messages(observation, "step")
        reward = float(reward)
        if not math.isfinite(reward):
            raise EnvironmentFault(f"step returned reward {reward}")
        conversation += observation
        return observation, reward, bool(done), len(message.get("tool_calls") or [])

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
