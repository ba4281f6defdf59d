"""Multi-turn rollouts with tools over any rollout engine, token-in / token-out.

:class:`AgentLoop` is itself a :class:`~megarl.rollout.engine.RolloutEngine`:
the trainer calls ``generate`` as on a plain engine, one request per sample.
Per sample, a state machine over turns:

    generate until EOS or the tool-call end token (a stop id of the engine)
      -> tool-call end: parse the turn's calls (Hermes ``<tool_call>{json}</tool_call>``
         or a ``module:function`` parser), run every active sample's calls at once
         in the tool executor's worker pool, append the tool messages
      -> EOS with an interaction (simulated user): its next message, or the end
      -> with an environment (``environments.py``), every turn: its ``step`` on the
         conversation gives observation messages, a reward and done (reset gave the prompt)
      -> append the context ids (``turns.py``: the template's close of the turn,
         the messages, the next assistant opening) with loss mask 0; continue

Token-in/token-out: a sample's response is the concatenation of the ids the
engine sampled (loss mask 1, their log-probs) and the appended ids (loss mask
0, log-prob 0): nothing is decoded and re-encoded. Text is decoded only to
parse calls and to give rewards the conversation (``extra["trajectory"]``,
OpenAI-style messages with the tool calls and results). With
``actor.router_replay=r3`` the result also carries the expert ids of every
position, merged turn by turn (:mod:`megarl.rollout.expert_record`: a sampled
token's from its turn's step, appended context's from the next turn's prefill).

Seeds: a sample draws turn 0 from its request's seed (turn 0 of every sample
is one engine call, so the samples of one prompt share its prefill) and turn
k > 0 from ``mix_seed(mix_seed(seed, k), 0)`` (:func:`turn_seed`): a sample's
tokens depend on its seed, the weights and its tool results only.

Limits: ``max_turns`` assistant turns (then finish "max_turns"), the response
budget (sampled + appended tokens <= max_new_tokens; finish "length"), each
tool output cut to ``max_tool_output_tokens`` tokens with a note saying so.
Tools and the interaction run on the replica's first rank only; their results
are broadcast to the TP and PP peers, so every rank extends the same sequences.
A conversation's earlier pages are reused when the native engine's
``rollout.prefix_cache`` is on (each turn re-sends the whole sequence).

Two schedules, the same samples (``overlap_tools``):

* by turns (the reference): one ``engine.generate`` per turn over every active
  sample; the turn's calls start when its slowest sample is decoded, and the
  next turn when its slowest call returns;
* overlapped (``agent_overlap.py``, engines with ``serve``): a sample's calls
  start the moment its turn is recorded, and its next turn joins the running
  batch as soon as they return, while the other samples go on decoding.

A sample's turn k has the same prompt (its ids so far) and seed either way, and
the engine's tokens depend on those alone, so both give the same ids, masks and
log-probs (an ``interaction`` must then be a function of its messages: the two
call it in different orders).
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import torch.distributed as dist

from megarl.rollout.engine import GenerationResult, Request, RolloutEngine, SamplingParams, mix_seed
from megarl.rollout.environments import EnvironmentRunner, one_line
from megarl.rollout.expert_record import merge, positions, split
from megarl.rollout.turns import TurnRenderer


def turn_seed(seed: int, turn: int) -> int:
    """The seed of a sample's turn ``turn``: its request's ``seed`` for turn 0, else
    ``mix_seed(mix_seed(seed, turn), 0)`` — the trailing 0 is how engines drew a lone request's
    sample when they still expanded n, so multi-turn runs keep the tokens they sampled then."""
    return seed if turn == 0 else mix_seed(mix_seed(seed, turn), 0)


@dataclass(frozen=True)
class AgentOptions:
    tool_call_end: int  # token id that ends a tool call (stops generation)
    max_turns: int = 4  # assistant turns per sample
    max_tool_output_tokens: int = 256  # per tool message
    overlap_tools: bool = False  # calls overlap decoding (engine.serve); False: turn by turn (the reference)
    max_prompt_len: int = 0  # environment: longest opening prompt its reset may give (0: any)


@dataclass(frozen=True)
class Reply:
    """What answers a sample's turn; made on the replica's first rank, broadcast to its peers."""

    messages: list[dict] | None  # tool results or a user turn; None: the conversation ends
    tool_calls: int = 0  # calls the turn made
    tool_errors: int = 0  # of them failed (unknown tool, bad arguments, exception, timeout), plus unparsable calls
    tool_truncations: int = 0  # tool outputs cut (max_tool_output_tokens, or the executor's character limit)
    reward: float = 0.0  # environment: the step's reward
    error: str = ""  # environment: why the sample failed (its step raised, broke the interface, timed out)


@dataclass
class Trajectory:
    """One sample: its response region as chunks of sampled and appended ids."""

    prompt_ids: list[int]
    key: int  # its request's key: the result's
    seed: int  # its request's seed (turn 0)
    budget: int  # response tokens allowed (sampled + appended)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # assistant / tool / user, for rewards
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_truncations: int = 0
    finish: str | None = None
    last_turn: list[int] = field(default_factory=list)  # the last sampled turn: the answer rewards read
    reward: float = 0.0  # environment: the sum of its steps' rewards
    error: str = ""  # environment: set when the sample failed (it then trains nothing)
    # MoE, recorded: (positions so far, layers, k) expert ids of prompt + ids, earliest call's first
    # (megarl/rollout/expert_record.py): sampled tokens from their turn, context from the next turn's prefill
    experts: np.ndarray | None = None

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

    def fail(self, error: str) -> None:
        self.error, self.finish = error, "failed"

    def result(self, environment: bool = False, pad_id: int = 0) -> GenerationResult:
        """The sample for the trainer; with an ``environment`` its reward (``agent_reward``, the reward
        term ``agent``) and whether it failed: a failed sample keeps its ids with loss mask 0 (one pad
        id if it sampled nothing), so it trains nothing."""
        extra = {"trajectory": self.messages, "turns": self.turns, "tool_calls": self.tool_calls,
                 "final_turn_ids": self.last_turn}
        ids, logprobs, mask = self.ids, self.logprobs, self.loss_mask
        if environment:
            failed = bool(self.error)
            extra.update(agent_reward=self.reward, agent_failed=failed, agent_error=self.error)
            if failed:
                ids, logprobs = (ids, logprobs) if ids else ([pad_id], [0.0])
                mask = [0] * len(ids)
        prompt_experts, experts = split(self.experts, len(self.prompt_ids), len(ids))
        return GenerationResult(self.prompt_ids, ids, logprobs, self.finish or "length", self.key, extra,
                                loss_mask=mask, expert_ids=experts, prompt_expert_ids=prompt_experts)


class AgentLoop:
    """Multi-turn generation with tools; see the module docstring."""

    def __init__(self, engine: RolloutEngine, tokenizer, executor, parser: Callable, options: AgentOptions,
                 groups=None, interaction: Callable | None = None, environment: EnvironmentRunner | None = None):
        if options.overlap_tools and not hasattr(engine, "serve"):
            raise ValueError(f"overlap_tools needs an engine that admits requests while it runs (serve); "
                             f"{type(engine).__name__} has none")
        self.engine, self.tokenizer, self.executor, self.parser = engine, tokenizer, executor, parser
        self.options, self.groups, self.interaction = options, groups, interaction
        self.environment = environment  # answers every turn instead of the tools and the interaction
        self.items: dict[int, dict] = {}  # request key -> dataset row fields, for the environments' reset
        self.renderer = TurnRenderer(tokenizer)
        self.stats: dict[str, float] = {}
        self._users: ThreadPoolExecutor | None = None  # overlapped: the interaction's one thread

    # -- RolloutEngine -------------------------------------------------------
    def generate(self, requests: list[Request], params: SamplingParams) -> list[GenerationResult]:
        """One trajectory per request (its prompt, seed and response budget), results in request order
        under the requests' keys. Turn 0 of every sample is one engine call (``generate`` or the start
        of ``serve``), so requests with identical prompts share its prefill; the engine sees each
        sample under its position in ``requests``."""
        trajs = [Trajectory(list(r.prompt), r.key, r.seed, r.max_new_tokens) for r in requests]
        if self.environment is not None:
            self._reset(requests, trajs)
        turn = replace(params, stop_token_ids=tuple(params.stop_token_ids) + (self.options.tool_call_end,))
        first = [self.next_request(i, t) for i, t in enumerate(trajs) if t.finish is None]
        if not first:  # every environment's reset failed
            waited = 0.0
        elif self.options.overlap_tools:
            from megarl.rollout.agent_overlap import OverlappedTurns

            feed = OverlappedTurns(self, trajs)
            self.engine.serve(first, turn, feed)
            waited = feed.waited_s
        else:
            waited = self._by_turns(first, turn, [t for t in trajs if t.finish is None])
        self._record(trajs, waited)
        self.items = {}
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        return [t.result(self.environment is not None, pad) for t in trajs]

    def bind_items(self, items: dict[int, dict]) -> None:
        """Dataset fields per request key for the next ``generate`` (``messages``, ``answer``, ``extra``):
        what an environment's ``reset`` gets besides the prompt."""
        self.items = items

    def _reset(self, requests: list[Request], trajs: list[Trajectory]) -> None:
        """Every sample's environment reset (first rank, broadcast): its opening messages are its prompt;
        a reset that fails, or whose prompt is longer than ``max_prompt_len``, fails its sample."""
        samples = {r.key: {"key": r.key, "prompt_ids": list(r.prompt), **self.items.get(r.key, {}),
                           "prompt_text": self.tokenizer.decode(r.prompt, skip_special_tokens=False)}
                   for r in requests}
        prompts = self.on_first_rank(lambda: self.environment.reset_all(samples))
        limit = self.options.max_prompt_len
        for t in trajs:
            got = prompts[t.key]
            if isinstance(got, str):
                t.fail(got)
            elif limit and len(got) > limit:
                t.prompt_ids = got
                t.fail(f"reset: the opening messages are {len(got)} tokens; data.max_prompt_len is {limit}")
            else:
                t.prompt_ids = got

    def update_weights(self) -> dict:
        return self.engine.update_weights()

    def release_memory(self) -> None:
        self.engine.release_memory()

    def resume_memory(self) -> None:
        self.engine.resume_memory()

    # -- turn by turn (the reference schedule) -------------------------------
    def _by_turns(self, first: list[Request], turn: SamplingParams, trajs: list[Trajectory]) -> float:
        """Every active sample's turn in one engine call (``first``: turn 0's requests, one per
        trajectory of ``trajs``), then their replies; returns the seconds spent on replies (the engine idle)."""
        if not trajs:
            return 0.0
        waited = self._after_turn(trajs, self.engine.generate(first, turn))  # identical prompts share a prefill
        while active := [t for t in trajs if t.finish is None]:
            results = self.engine.generate([self.next_request(i, t) for i, t in enumerate(active)], turn)
            waited += self._after_turn(active, results)
        return waited

    def _after_turn(self, trajs: list[Trajectory], results: list[GenerationResult]) -> float:
        """Adds each sample's sampled turn, then the context that continues it (or ends it)."""
        texts = [self.add_turn(t, r) for t, r in zip(trajs, results)]
        called = [self.ends_with_call(r) for r in results]
        if self.environment is not None:
            start = time.perf_counter()
            replies = self.on_first_rank(lambda: [self.env_reply(f) for f in [
                self.environment.submit_step(t.key, text) for t, text in zip(trajs, texts)]])
            waited = time.perf_counter() - start
            for t, r, reply in zip(trajs, results, replies):
                self.continue_after(t, r.finish_reason, reply)
            return waited
        start = time.perf_counter()
        replies = self.on_first_rank(lambda: self._replies(trajs, results, texts, called))
        waited = time.perf_counter() - start
        for t, r, reply in zip(trajs, results, replies):
            self.continue_after(t, r.finish_reason, reply)
        return waited

    def _replies(self, trajs, results, texts, called) -> list[Reply]:
        """Per sample the reply to its turn. Every sample's tool calls go to the executor together
        (its pool runs them concurrently)."""
        parsed = [self.parser(text) if c else ([], []) for text, c in zip(texts, called)]
        flat = [call for calls, _ in parsed for call in calls]
        outputs = iter(self.executor.run(flat) if flat else [])
        replies = []
        for t, r, did_call, (calls, problems) in zip(trajs, results, called, parsed):
            if did_call:
                replies.append(self.tool_reply(calls, [next(outputs) for _ in calls], problems))
            elif self.asks_user(r):
                replies.append(self.user_reply(t.messages))
            else:
                replies.append(Reply(None))
        return replies

    # -- one sample's turn (both schedules) ----------------------------------
    def add_turn(self, t: Trajectory, r: GenerationResult) -> str:
        """Appends a sampled turn (and its recorded experts) to its sample; returns its text."""
        text = self.tokenizer.decode(r.response_ids, skip_special_tokens=False)
        t.add_sampled(r.response_ids, r.logprobs, text)
        t.experts = merge(t.experts, positions(r))  # r's prompt is t's sequence before this turn
        return text

    def ends_with_call(self, r: GenerationResult) -> bool:
        return r.finish_reason == "stop" and bool(r.response_ids) and r.response_ids[-1] == self.options.tool_call_end

    def asks_user(self, r: GenerationResult) -> bool:
        """A turn without a call that the simulated user answers (if it has more to say)."""
        return self.interaction is not None and r.finish_reason == "stop" and not self.ends_with_call(r)

    def wants_reply(self, r: GenerationResult) -> bool:
        """The turn is answered: every turn by an environment, else a tool call or the simulated user's turn."""
        return self.environment is not None or self.ends_with_call(r) or self.asks_user(r)

    def continue_after(self, t: Trajectory, finish: str, reply: Reply) -> None:
        """Appends ``reply``'s context to ``t``, or ends it (``finish``: its last turn's reason)."""
        t.tool_calls += reply.tool_calls
        t.tool_errors += reply.tool_errors
        t.tool_truncations += reply.tool_truncations
        t.reward += reply.reward
        if reply.error:
            t.fail(reply.error)
            return
        if reply.messages is None:
            t.finish = finish
            return
        if t.turns >= self.options.max_turns:
            t.finish = "max_turns"
            return
        ids = self.renderer.ids_after_assistant(reply.messages)
        if finish == "stop" and ids[:1] == t.ids[-1:]:
            ids = ids[1:]  # the turn stopped on the token the template's close of the turn starts with
        if len(t.ids) + len(ids) >= t.budget:  # no room left to sample after the context
            t.finish = "length"
            return
        t.add_context(ids, reply.messages)

    def next_request(self, key: int, t: Trajectory) -> Request:
        """A sample's next turn under the engine key ``key``: everything so far as the prompt, the turn's
        own seed (:func:`turn_seed`), the budget left."""
        return Request(key, t.prompt_ids + t.ids, turn_seed(t.seed, t.turns), t.budget - len(t.ids))

    def tool_reply(self, calls, outputs, problems: list[str]) -> Reply:
        limit = self.options.max_tool_output_tokens
        texts = [self.renderer.truncate(o.text, limit) for o in outputs]
        messages = [{"role": "tool", "name": c.name, "content": text} for c, text in zip(calls, texts)]
        messages += [{"role": "tool", "content": f"error: {p}"} for p in problems]
        errors = sum(not o.ok for o in outputs) + len(problems) + (not messages)
        cut = sum(o.truncated or text != o.text for o, text in zip(outputs, texts))
        return Reply(messages or [{"role": "tool", "content": "error: no tool call found before </tool_call>"}],
                     len(calls), errors, cut)

    def env_reply(self, step: Future) -> Reply:
        """First rank: the reply of an environment's step (observations cut to max_tool_output_tokens)."""
        try:
            observation, reward, done, calls = step.result()
        except Exception as e:  # noqa: BLE001 - the sample's failure, not the rollout's
            return Reply(None, error=f"step: {one_line(e)}")
        if done:
            return Reply(None, calls, reward=reward)
        limit = self.options.max_tool_output_tokens
        messages = [{**m, "content": self.renderer.truncate(m["content"], limit)} for m in observation]
        cut = sum(m["content"] != o["content"] for m, o in zip(messages, observation))
        return Reply(messages, calls, tool_truncations=cut, reward=reward)

    def user_reply(self, messages: list[dict]) -> Reply:
        user = self.interaction(messages)
        return Reply(None if user is None else [{"role": "user", "content": str(user)}])

    def submit_reply(self, t: Trajectory, text: str, called: bool) -> Future:
        """First rank, overlapped: the reply to ``t``'s turn, started now (tools in the executor's pool,
        the interaction on its own thread, an environment's step on its runner's pool)."""
        if self.environment is not None:
            env_done: Future = Future()
            self.environment.submit_step(t.key, text).add_done_callback(
                lambda step: env_done.set_result(self.env_reply(step)))
            return env_done
        if not called:
            if self._users is None:
                self._users = ThreadPoolExecutor(1, thread_name_prefix="megarl-interaction")
            return self._users.submit(self.user_reply, list(t.messages))
        calls, problems = self.parser(text)
        reply: Future = Future()

        def build(outputs: Future) -> None:
            try:
                reply.set_result(self.tool_reply(calls, outputs.result(), problems))
            except BaseException as e:  # noqa: BLE001 - raised where the reply is read
                reply.set_exception(e)

        if calls:
            self.executor.submit(calls).add_done_callback(build)
        else:
            done: Future = Future()
            done.set_result([])
            build(done)
        return reply

    # -- ranks ---------------------------------------------------------------
    @property
    def is_first_rank(self) -> bool:
        """The replica's first rank (TP rank 0 of the first stage): it runs tools and the interaction."""
        g = self.groups
        return g is None or (g.tp_rank == 0 and g.pp_rank == 0)

    def on_first_rank(self, fn):
        """``fn()`` on the replica's first rank, broadcast to its peers."""
        g = self.groups
        if g is None or (g.tp_size == 1 and g.pp_size == 1):
            return fn()
        box = [fn() if self.is_first_rank else None]
        if g.pp_size > 1 and g.tp_rank == 0:
            dist.broadcast_object_list(box, group=g.pp, group_src=0)
        if g.tp_size > 1:
            dist.broadcast_object_list(box, group=g.tp, group_src=0)
        return box[0]

    def _record(self, trajs: list[Trajectory], waited_s: float) -> None:
        n = max(len(trajs), 1)
        self.stats = {
            **getattr(self.engine, "stats", {}),  # the engine's counters: the last turn's, or the whole serve
            "agent/overlap_tools": float(self.options.overlap_tools),
            "timing/agent_tool_wait": waited_s,  # seconds the engine had nothing to run but tools to wait for
            "agent/turns_mean": sum(t.turns for t in trajs) / n,
            "agent/tool_calls_mean": sum(t.tool_calls for t in trajs) / n,
            "agent/tool_errors_mean": sum(t.tool_errors for t in trajs) / n,
            "agent/tool_truncations_mean": sum(t.tool_truncations for t in trajs) / n,
            "agent/max_turns_frac": sum(t.finish == "max_turns" for t in trajs) / n,
            "agent/context_tokens_mean": sum(len(t.ids) - sum(t.loss_mask) for t in trajs) / n,
        }
        if self.environment is not None:
            self.stats.update({
                "agent/env_failed_frac": sum(bool(t.error) for t in trajs) / n,  # reset or step raised / timed out
                "agent/env_reward_mean": sum(t.reward for t in trajs) / n,
            })
