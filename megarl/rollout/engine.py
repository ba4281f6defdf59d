"""The rollout interface every engine implements.

Requests are token-in / token-out: prompt token ids in, response token ids
(with the log-prob of each sampled token under the sampling temperature) out.
All ranks of one TP group (and PP group) call :meth:`RolloutEngine.generate`
together with the same prompts and get the same results.
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
