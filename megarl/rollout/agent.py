"""Multi-turn rollouts with tools over any rollout engine, token-in / token-out.

:class:`AgentLoop` is itself a :class:`~megarl.rollout.engine.RolloutEngine`:
the trainer calls ``generate`` as on a plain engine. Per sample, a state
machine over turns:

    generate until EOS or the tool-call end token (a stop id of the engine)
      -> tool-call end: parse the turn's calls (Hermes ``<tool_call>{json}</tool_call>``
         or a ``module:function`` parser), run every active sample's calls at once
         in the tool executor's worker pool, append the tool messages
      -> EOS with an interaction (simulated user): its next message, or the end
      -> append the context ids (``turns.py``: the template's close of the turn,
         the messages, the next assistant opening) with loss mask 0; continue

Token-in/token-out: a sample's response is the concatenation of the ids the
engine sampled (loss mask 1, their log-probs) and the appended ids (loss mask
0, log-prob 0): nothing is decoded and re-encoded. Text is decoded only to
parse calls and to give rewards the conversation (``extra["trajectory"]``,
OpenAI-style messages with the tool calls and results).

Seeds: sample j of prompt i draws turn 0 from ``mix_seed(seeds[i], j)`` (the
engine's own n-fold rule: the n samples share the prompt's prefill) and turn
k > 0 from ``mix_seed(mix_seed(seeds[i], j), k)``: a sample's tokens depend on
its seed, the weights and its tool results only.

Limits: ``max_turns`` assistant turns (then finish "max_turns"), the response
budget (sampled + appended tokens <= max_new_tokens; finish "length"), each
tool output cut to ``max_tool_output_tokens`` tokens with a note saying so.
Tools and the interaction run on the replica's first rank only; their results
are broadcast to the TP and PP peers, so every rank extends the same sequences.
A conversation's earlier pages are reused when the native engine's
``rollout.prefix_cache`` is on (each turn re-sends the whole sequence).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch.distributed as dist

from megarl.rollout.engine import GenerationResult, RolloutEngine, SamplingParams
from megarl.rollout.turns import TurnRenderer


@dataclass(frozen=True)
class AgentOptions:
    tool_call_end: int  # token id that ends a tool call (stops generation)
    max_turns: int = 4  # assistant turns per sample
    max_tool_output_tokens: int = 256  # per tool message


@dataclass
class Trajectory:
    """One sample: its response region as chunks of sampled and appended ids."""

    prompt_ids: list[int]
    prompt_index: int
    seed: int
    budget: int  # response tokens allowed (sampled + appended)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # assistant / tool / user, for rewards
    turns: int = 0
    tool_calls: int = 0
    finish: str | None = None
    last_turn: list[int] = field(default_factory=list)  # the last sampled turn: the answer rewards read

    def add_sampled(self, ids: list[int], logprobs: list[float], text: str) -> None:
        self.last_turn = list(ids)
        self.ids += ids
        self.logprobs += logprobs
        self.loss_mask += [1] * len(ids)
        self.messages.append({"role": "assistant", "content": text})
        self.turns += 1

    def add_context(self, ids: list[int], messages: list[dict]) -> None:
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)
        self.messages += messages

    def result(self) -> GenerationResult:
        return GenerationResult(self.prompt_ids, self.ids, self.logprobs, self.finish or "length", self.prompt_index,
                                {"trajectory": self.messages, "turns": self.turns, "tool_calls": self.tool_calls,
                                 "final_turn_ids": self.last_turn},
                                loss_mask=self.loss_mask)


class AgentLoop:
    """Multi-turn generation with tools; see the module docstring."""

    def __init__(self, engine: RolloutEngine, tokenizer, executor, parser: Callable, options: AgentOptions,
                 groups=None, interaction: Callable | None = None):
        self.engine, self.tokenizer, self.executor, self.parser = engine, tokenizer, executor, parser
        self.options, self.groups, self.interaction = options, groups, interaction
        self.renderer = TurnRenderer(tokenizer)
        self.stats: dict[str, float] = {}

    # -- RolloutEngine -------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int] | None = None,
                 max_new_tokens: list[int] | None = None) -> list[GenerationResult]:
        from megarl.rollout.native import mix_seed

        base = seeds if seeds is not None else [mix_seed(params.seed, i) for i in range(len(prompts))]
        limits = max_new_tokens or [params.max_new_tokens] * len(prompts)
        trajs = [Trajectory(list(p), i, mix_seed(base[i], j), limits[i])
                 for i, p in enumerate(prompts) for j in range(params.n)]
        turn = replace(params, stop_token_ids=tuple(params.stop_token_ids) + (self.options.tool_call_end,))
        first = self.engine.generate(prompts, turn, seeds=base, max_new_tokens=limits)  # n samples share a prefill
        self._after_turn(trajs, first)
        while active := [t for t in trajs if t.finish is None]:
            results = self.engine.generate(
                [t.prompt_ids + t.ids for t in active], replace(turn, n=1),
                seeds=[mix_seed(t.seed, t.turns) for t in active],
                max_new_tokens=[t.budget - len(t.ids) for t in active])
            self._after_turn(active, results)
        self._record(trajs)
        return [t.result() for t in trajs]

    def update_weights(self) -> dict:
        return self.engine.update_weights()

    def release_memory(self) -> None:
        self.engine.release_memory()

    def resume_memory(self) -> None:
        self.engine.resume_memory()

    # -- one turn ------------------------------------------------------------
    def _after_turn(self, trajs: list[Trajectory], results: list[GenerationResult]) -> None:
        """Adds each sample's sampled turn, then the context that continues it (or ends it)."""
        texts = [self.tokenizer.decode(r.response_ids, skip_special_tokens=False) for r in results]
        for t, r, text in zip(trajs, results, texts):
            t.add_sampled(r.response_ids, r.logprobs, text)
        called = [self._ends_with_call(t, r) for t, r in zip(trajs, results)]
        replies = self._on_first_rank(lambda: self._replies(trajs, results, texts, called))
        for t, r, reply in zip(trajs, results, replies):
            if reply is None:
                t.finish = r.finish_reason
                continue
            if t.turns >= self.options.max_turns:
                t.finish = "max_turns"
                continue
            ids = self.renderer.ids_after_assistant(reply)
            if len(t.ids) + len(ids) >= t.budget:  # no room left to sample after the context
                t.finish = "length"
                continue
            t.add_context(ids, reply)

    def _ends_with_call(self, t: Trajectory, r: GenerationResult) -> bool:
        return r.finish_reason == "stop" and bool(r.response_ids) and r.response_ids[-1] == self.options.tool_call_end

    def _replies(self, trajs, results, texts, called) -> list[list[dict] | None]:
        """Per sample the messages that answer its turn (tool results, a user turn), or None: it is done.
        Every sample's tool calls go to the executor together (its pool runs them concurrently)."""
        parsed = [self.parser(text) if c else ([], []) for text, c in zip(texts, called)]
        flat = [call for calls, _ in parsed for call in calls]
        outputs = iter(self.executor.run(flat) if flat else [])
        replies = []
        for t, r, text, did_call, (calls, problems) in zip(trajs, results, texts, called, parsed):
            if did_call:
                t.tool_calls += len(calls)
                replies.append(self._tool_messages(calls, [next(outputs) for _ in calls], problems))
            elif self.interaction is not None and r.finish_reason == "stop":
                user = self.interaction(t.messages)
                replies.append(None if user is None else [{"role": "user", "content": str(user)}])
            else:
                replies.append(None)
        return replies

    def _tool_messages(self, calls, outputs, problems: list[str]) -> list[dict]:
        limit = self.options.max_tool_output_tokens
        messages = [{"role": "tool", "name": c.name, "content": self.renderer.truncate(o.text, limit)}
                    for c, o in zip(calls, outputs)]
        messages += [{"role": "tool", "content": f"error: {p}"} for p in problems]
        return messages or [{"role": "tool", "content": "error: no tool call found before </tool_call>"}]

    def _on_first_rank(self, fn):
        """``fn()`` on the replica's first rank (TP rank 0 of the first stage), broadcast to its peers."""
        g = self.groups
        if g is None or (g.tp_size == 1 and g.pp_size == 1):
            return fn()
        box = [fn() if g.tp_rank == 0 and g.pp_rank == 0 else None]
        if g.pp_size > 1 and g.tp_rank == 0:
            dist.broadcast_object_list(box, group=g.pp, group_src=0)
        if g.tp_size > 1:
            dist.broadcast_object_list(box, group=g.tp, group_src=0)
        return box[0]

    def _record(self, trajs: list[Trajectory]) -> None:
        n = max(len(trajs), 1)
        self.stats = {
            **getattr(self.engine, "stats", {}),  # the last turn's engine counters
            "agent/turns_mean": sum(t.turns for t in trajs) / n,
            "agent/tool_calls_mean": sum(t.tool_calls for t in trajs) / n,
            "agent/max_turns_frac": sum(t.finish == "max_turns" for t in trajs) / n,
            "agent/context_tokens_mean": sum(len(t.ids) - sum(t.loss_mask) for t in trajs) / n,
        }
