"""Agents in their own code: an OpenAI endpoint on the engine, many agents calling it at once.

:class:`HttpAgentRollout` is a :class:`~megarl.rollout.engine.RolloutEngine`:
per ``generate`` call it opens a session per request (sample), runs the agent
``module:function(sample, base_url) -> reward | dict`` for every sample on
``rollout.server.workers`` threads, of this process or of
``rollout.server.agent_processes`` worker processes (:mod:`megarl.rollout.agent_workers`), and meanwhile runs the engine's
``serve`` loop, whose follow-ups are the HTTP calls the agents make
(:class:`~megarl.rollout.http_server.EngineQueue`): calls that arrive while a
step runs join the next one. The loop ends when every agent has returned,
raised or run past ``rollout.server.timeout_s``.

``sample`` is a dict: ``key`` (the id in ``base_url``), ``prompt_ids``,
``prompt_text`` (the dataset prompt as tokenized), and when the trainer binds
its prompts (:meth:`bind_items`), ``messages``, ``answer`` and ``extra`` of the
dataset row. ``base_url`` is ``http://host:port/samples/<key>/v1``: give it
to ``openai.OpenAI(base_url=..., api_key=...)``.

Each result is the sample's recorded token-in/token-out chain
(:mod:`megarl.rollout.http_sessions`), ``extra["agent_reward"]`` the float the
agent returned (or its dict's ``"reward"``), ``extra["agent_result"]`` its
dict. A sample whose agent raised, timed out or made no call is *failed*: kept
with loss mask 0 (it trains nothing), counted in ``agent_http/failed_frac``.
One process serves its own samples (each DP rank its own port); TP/PP > 1 is
refused at config time.
"""
from __future__ import annotations

import time
from concurrent.futures import wait

from megarl.rollout.agent_workers import AgentFailed, agent_workers
from megarl.rollout.engine import GenerationResult, Request, SamplingParams
from megarl.rollout.http_server import EngineQueue, HttpServer, ServerState
from megarl.rollout.http_sessions import SampleSession
from megarl.rollout.turns import TurnRenderer


class _AgentFeed:
    """``serve``'s follow-ups: the agents' calls in, their results out; idle until the agents are done."""

    def __init__(self, queue: EngineQueue, agents_done):
        self.queue, self.agents_done = queue, agents_done

    def finished(self, key: int, result: GenerationResult) -> None:
        self.queue.finished(key, result)

    @property
    def streamed(self) -> dict:
        return self.queue.streamed

    def progress(self, key: int, ids: list[int], logprobs: list[float]) -> None:
        self.queue.progress(key, ids, logprobs)

    def pending(self) -> bool:
        """More calls may come: some agent is still running."""
        return not self.agents_done()

    def poll(self, idle: bool) -> list[Request]:
        while True:
            got = self.queue.take(0.02 if idle else 0)
            if got or not idle or self.agents_done():
                return got


class HttpAgentRollout:
    """Rollout through agents that call an OpenAI endpoint; see the module docstring."""

    def __init__(self, engine, tokenizer, agent, parser, eos_ids: list[int], pad_id: int, *, host: str,
                 port: int, workers: int, timeout_s: float, model_name: str, max_len: int, stop_ids: list[int],
                 agent_processes: int = 0):
        if not hasattr(engine, "serve"):
            raise ValueError(f"rollout.server needs an engine that admits requests while it runs (serve); "
                             f"{type(engine).__name__} has none")
        self.engine, self.tokenizer, self.agent = engine, tokenizer, agent
        self.pad_id, self.timeout_s, self.max_len, self.stop_ids = pad_id, timeout_s, max_len, tuple(stop_ids)
        self.state = ServerState(tokenizer, TurnRenderer(tokenizer), parser, model_name, eos_ids)
        self.server = HttpServer(self.state, host, port)
        self.workers = agent_workers(workers, agent_processes)
        self.items: dict[int, dict] = {}
        self.stats: dict[str, float] = {}

    def bind_items(self, items: dict[int, dict]) -> None:
        """Dataset fields per request key for the next ``generate`` (``messages``, ``answer``, ``extra``)."""
        self.items = items

    # -- RolloutEngine -------------------------------------------------------
    def generate(self, requests: list[Request], params: SamplingParams) -> list[GenerationResult]:
        state = self.state
        state.temperature = params.temperature
        state.longest = self.max_len
        sessions = {r.key: SampleSession(r.key, r.seed, r.max_new_tokens, state.eos_ids) for r in requests}
        state.sessions = {str(k): s for k, s in sessions.items()}
        calls = [(r.key, self._sample(r), f"{self.server.url}/samples/{r.key}/v1") for r in requests]
        futures = self.workers.start(self.agent, calls, self.timeout_s)
        deadline = time.monotonic() + self.timeout_s
        done = lambda: time.monotonic() > deadline or all(f.done() for f in futures.values())  # noqa: E731
        params = SamplingParams(params.temperature, params.top_p, params.top_k,
                                tuple(params.stop_token_ids) + self.stop_ids)
        self.engine.serve([], params, _AgentFeed(state.queue, done), reserve=(len(requests), self.max_len))
        wait(list(futures.values()), timeout=max(0.0, deadline + self.workers.report_s - time.monotonic()))
        for s in sessions.values():
            s.closed = True
        state.queue.fail_waiting("the rollout this sample belonged to has ended")
        results = [self._result(r, sessions[r.key], futures[r.key]) for r in requests]
        self._record(sessions.values(), results)
        self.items = {}
        return results

    def _sample(self, r: Request) -> dict:
        item = self.items.get(r.key, {})
        return {"key": r.key, "prompt_ids": list(r.prompt),
                "prompt_text": self.tokenizer.decode(r.prompt, skip_special_tokens=False), **item}

    def _result(self, r: Request, session: SampleSession, future) -> GenerationResult:
        failed, extra = True, {"agent_error": "timed out"}
        if future.done():
            try:
                out = future.result()
                reward = out.get("reward") if isinstance(out, dict) else out
                extra = {"agent_reward": None if reward is None else float(reward),
                         "agent_result": out if isinstance(out, dict) else {}}
                failed = False
            except AgentFailed as e:  # it raised, or timed out in its worker process: a failed sample
                extra = {"agent_error": str(e)}
        return session.result(r.prompt, self.pad_id, failed, extra)

    def _record(self, sessions, results: list[GenerationResult]) -> None:
        n = max(len(results), 1)
        self.stats = {
            **getattr(self.engine, "stats", {}),
            "agent_http/failed_frac": sum(r.extra["agent_failed"] for r in results) / n,
            "agent_http/calls_mean": sum(s.calls for s in sessions) / n,
            "agent_http/chain_resets_mean": sum(s.chain_resets for s in sessions) / n,
            "agent_http/bad_requests": float(self.state.bad_requests),
        }
        self.state.bad_requests = 0

    def update_weights(self) -> dict:
        return self.engine.update_weights()

    def release_memory(self) -> None:
        self.engine.release_memory()

    def resume_memory(self) -> None:
        self.engine.resume_memory()

    def close(self) -> None:
        self.server.close()
        self.workers.close()
