"""The rollout interface every engine implements.

Requests are token-in / token-out: prompt token ids in, response token ids
(with the log-prob of each sampled token under the sampling temperature) out.
All ranks of one TP group (and PP group) call :meth:`RolloutEngine.generate`
together with the same prompts and get the same results.

An engine that can admit requests into a running generation (the native one)
also has ``serve(prompts, params, feed, seeds, max_new_tokens)``: the same
initial requests, but each finished request goes to ``feed.finished`` at once
and ``feed.poll`` hands it :class:`Request` follow-ups between steps (see
:class:`FollowUps`); the multi-turn agent loop uses it to overlap tool calls
with decoding.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token."""

    max_new_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1  # samples per prompt
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class GenerationResult:
    """One sampled response."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # per response token, under temperature (1.0 when greedy)
    finish_reason: str  # "stop" | "length" | "max_turns"
    prompt_index: int = 0  # which prompt of the request it answers
    extra: dict = field(default_factory=dict)
    loss_mask: list[int] | None = None  # per response token: 1 sampled by the model, 0 appended context
    #                                     (tool / user / template tokens); None: every token sampled


@dataclass(frozen=True)
class Request:
    """One request admitted into a running generation (``serve``); n = 1, the call's sampling params."""

    key: int  # the caller's name for it: its result comes back under this key (and as prompt_index)
    prompt: list[int]
    seed: int  # drawn as generate([prompt], seeds=[seed]) would: tokens depend on it, weights, prompt only
    max_new_tokens: int


class FollowUps(Protocol):
    """The caller's side of ``serve``: results out as they finish, new requests in between steps.

    Every rank of a TP/PP replica gets the same calls at the same steps and must
    answer ``poll`` with the same requests (the caller agrees on them itself).
    """

    def finished(self, key: int, result: GenerationResult) -> None:
        """A request is done. Keys of the initial requests: ``i * n + j`` for sample j of prompt i."""

    def poll(self, idle: bool) -> list[Request]:
        """Requests to admit now. ``idle``: nothing else runs, so wait for one; [] then ends the call."""


class RolloutEngine(Protocol):
    """What the trainer needs from an inference engine."""

    def generate(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int] | None = None,
                 max_new_tokens: list[int] | None = None) -> list[GenerationResult]:
        """``n`` results per prompt, grouped by prompt, in order.

        ``seeds`` (one per prompt) fix each request's randomness, so its tokens do
        not depend on the other requests; ``max_new_tokens`` (one per prompt)
        overrides ``params.max_new_tokens``.
        """

    def update_weights(self) -> dict:
        """Take the actor's current weights; returns metrics (bytes moved, seconds)."""

    def release_memory(self) -> None:
        """Free caches before training."""

    def resume_memory(self) -> None:
        """Re-acquire what release_memory freed."""
