"""The rollout interface every engine implements.

Requests are token-in / token-out and one sample each: an engine call takes a
flat list of :class:`Request` (prompt token ids, a seed, a length limit) and
returns one :class:`GenerationResult` per request, in request order, under the
request's key (response token ids, with the log-prob of each sampled token
under the sampling temperature). n-fold sampling happens above the engine: the
caller repeats each prompt n times (:func:`sample_requests`), and the engine
shares the prefill of identical prompts itself (the native engine forks one
prefill's pages, SGLang's radix cache matches the prefix).

What every engine promises: a request's tokens depend only on its prompt, its
seed (used as is) and the weights — not on the other requests, their order or
the batch it ran in. All ranks of one TP group (and PP group) call
:meth:`RolloutEngine.generate` together with the same requests and get the same
results.

An engine that can admit requests into a running generation (the native one)
also has ``serve(requests, params, feed)``: the same initial requests, but each
finished request goes to ``feed.finished`` at once and ``feed.poll`` hands it
:class:`Request` follow-ups between steps (see :class:`FollowUps`); the
multi-turn agent loop uses it to overlap tool calls with decoding.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

_MASK64 = (1 << 64) - 1


def mix_seed(*words: int) -> int:
    """A 63-bit seed from integers (splitmix64 over their sequence)."""
    x = 0x9E3779B97F4A7C15
    for w in words:
        x = (x ^ (w & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        x = (x ^ (x >> 31)) * 0x94D049BB133111EB & _MASK64
        x ^= x >> 29
    return x >> 1


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token; the same for every request of a call (limits and seeds are per request)."""

    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    stop_token_ids: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class Request:
    """One sample to generate: the unit of every engine call (``generate``, ``serve`` and its follow-ups)."""

    key: int  # the caller's name for it, unique within a call: its result carries it (GenerationResult.key)
    prompt: list[int]
    seed: int  # the sampler's seed, used as is: the tokens depend on it, the prompt and the weights only
    max_new_tokens: int  # response length limit (the prefix counts against it)
    # a response resumed (partial rollouts): tokens already sampled, prefilled after the prompt, with their
    # log-probs; sampling continues at token index len(prefix) from the same seed, and the result's
    # response_ids / logprobs start with them
    prefix: tuple[int, ...] = ()
    prefix_logprobs: tuple[float, ...] = ()


def sample_requests(prompts: list[list[int]], n: int, seed: int, max_new_tokens: int | list[int]) -> list[Request]:
    """``n`` requests per prompt, grouped by prompt: request ``k = i * n + j`` is sample ``j`` of prompt
    ``i`` (key ``k``, so its prompt is ``key // n``) with seed ``mix_seed(mix_seed(seed, i), j)``.

    ``max_new_tokens``: one limit for all, or one per prompt. The seeds are the ones engines derived
    themselves when they expanded ``n``, so runs sample the same tokens as when they did.
    """
    limits = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
    if len(limits) != len(prompts):
        raise ValueError(f"max_new_tokens: {len(limits)} limits for {len(prompts)} prompts")
    return [Request(i * n + j, list(p), mix_seed(mix_seed(seed, i), j), limits[i])
            for i, p in enumerate(prompts) for j in range(n)]


@dataclass
class GenerationResult:
    """One sampled response."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # per response token, under temperature (1.0 when greedy)
    finish_reason: str  # "stop" | "length" | "max_turns" | "unfinished" (generate_until stopped it)
    key: int  # the key of the request it answers
    extra: dict = field(default_factory=dict)
    loss_mask: list[int] | None = None  # per response token: 1 sampled by the model, 0 appended context
    #                                     (tool / user / template tokens); None: every token sampled
    # MoE with EngineOptions.record_experts: (R, layers of this stage, k) expert ids (uint8, or int16 from 256
    # experts: router_replay.ids_dtype) that routed the row sampling each response token (its previous
    # token), largest weight first; unrecorded (router_replay.unrecorded) at tokens this call did not
    # sample (a resumed request's prefix: megarl/rollout/expert_record.py keeps their earlier ids)
    expert_ids: "np.ndarray | None" = None
    # with expert_ids: (P - 1, layers of this stage, k) the ids that routed prompt tokens 0 .. P - 2 in its
    # prefill (the same for every sample of a prompt: they share it), or in the forward that computed their
    # K/V where they came from the prefix cache; position P - 1 is expert_ids[0]
    prompt_expert_ids: "np.ndarray | None" = None
    versions: list[int] | None = None  # per response token: the policy version that sampled it (partial rollouts)


class FollowUps(Protocol):
    """The caller's side of ``serve``: results out as they finish, new requests in between steps.

    Every rank of a TP/PP replica gets the same calls at the same steps and must
    answer ``poll`` with the same requests (the caller agrees on them itself).
    """

    def finished(self, key: int, result: GenerationResult) -> None:
        """A request is done (an initial one or a follow-up): ``key`` is its request's key."""

    def poll(self, idle: bool) -> list[Request]:
        """Requests to admit now. ``idle``: nothing else runs, so wait for one; [] then ends the call."""

    # Optional, for expert parallelism across DP: ``pending() -> bool``, whether more requests may still
    # come (the same on every TP rank); with it, an idle rank keeps serving its EP group's steps while it
    # waits instead of blocking in ``poll(idle=True)`` (which would hold the group's other ranks).
    # Optional, for streaming: ``streamed``, a collection of keys (checked with ``in`` between steps),
    # and ``progress(key, ids, logprobs)``, called between steps with every token recorded so far of
    # each running request in ``streamed`` (the engine's own lists: copy what is kept). The last
    # tokens of a request come with ``finished``.


class RolloutEngine(Protocol):
    """What the trainer needs from an inference engine."""

    def generate(self, requests: list[Request], params: SamplingParams) -> list[GenerationResult]:
        """One result per request, in request order, each under its request's key.

        A request's tokens depend only on its prompt, seed and the weights (see the
        module docstring); requests with identical prompts may share their prefill.
        """

    def update_weights(self) -> dict:
        """Take the actor's current weights; returns metrics (bytes moved, seconds)."""

    def release_memory(self) -> None:
        """Free caches before training."""

    def resume_memory(self) -> None:
        """Re-acquire what release_memory freed."""
