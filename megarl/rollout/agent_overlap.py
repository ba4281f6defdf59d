"""The agent loop's overlapped schedule: tool calls run while the other samples decode.

:class:`OverlappedTurns` is the :class:`~megarl.rollout.engine.FollowUps` of one
``AgentLoop.generate`` on an engine with ``serve``. Per sample:

    turn recorded (``finished``) -> no call, no user and no environment: done
      -> a call, a user turn or an environment's step: its reply is started at once on the
         first rank (``AgentLoop.submit_reply``: the executor's pool / the interaction's thread /
         the environments' pool)
    between two engine steps (``poll``): replies that are ready are applied
      (context ids, limits) and each continuing sample's next turn is a Request
      the engine queues beside the sequences still decoding

Agreement across a TP/PP replica: every rank sees the same ``finished`` calls at
the same steps (identical schedulers), so every rank knows which samples wait
for a reply. While any does, each ``poll`` is one decision of the first rank —
the ready replies, in key order — broadcast to its peers
(``AgentLoop.on_first_rank``: over PP among TP rank 0, then over TP); all ranks
apply it before the same step, so they queue the same requests at the same
step. Polls with nothing awaited talk to nobody. When the engine is idle the
first rank blocks until one reply is ready (its peers block in the broadcast).
Cost: one ``broadcast_object_list`` per step while a reply is awaited (TP or
PP > 1 only). Over NCCL it waits for the step in flight, so the host stops
planning decode steps ahead during those steps; a CPU (gloo) group for the
decision would avoid that (not built: its gain has not been measured on a GPU).

A reply does not change a sample's tokens by when it lands: the next turn's
prompt and seed are the same as in the turn-by-turn schedule.
"""
from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_any

from megarl.rollout.engine import GenerationResult, Request


class OverlappedTurns:
    """Follow-ups of one overlapped ``generate``: the engine's keys are indices into ``trajs`` (the
    positions of their requests in the ``generate`` call)."""

    def __init__(self, loop, trajs: list):
        self.loop, self.trajs = loop, trajs
        self.awaiting: dict[int, str] = {}  # key -> finish reason of its last turn, on every rank
        self.replies: dict[int, Future] = {}  # key -> Future[Reply], on the first rank only
        self.waited_s = 0.0  # seconds the engine sat idle waiting for replies

    def finished(self, key: int, result: GenerationResult) -> None:
        t, loop = self.trajs[key], self.loop
        text = loop.add_turn(t, result)
        called = loop.ends_with_call(result)
        if not loop.wants_reply(result):
            t.finish = result.finish_reason
            return
        self.awaiting[key] = result.finish_reason
        if loop.is_first_rank:
            self.replies[key] = loop.submit_reply(t, text, called)

    def pending(self) -> bool:
        """More turns may come: some trajectory awaits its tool results (the same on every TP rank)."""
        return bool(self.awaiting)

    def poll(self, idle: bool) -> list[Request]:
        start = time.perf_counter()
        requests: list[Request] = []
        while self.awaiting and not requests:
            for key, reply in self.loop.on_first_rank(lambda: self._ready(wait=idle)):
                t = self.trajs[key]
                self.loop.continue_after(t, self.awaiting.pop(key), reply)
                if t.finish is None:
                    requests.append(self.loop.next_request(key, t))
            if not idle:
                break  # the engine has sequences to decode: ask again after its next step
        if idle:
            self.waited_s += time.perf_counter() - start
        return requests

    def _ready(self, wait: bool) -> list[tuple[int, object]]:
        """First rank: (key, Reply) of every reply that is ready, by key; ``wait``: at least one."""
        keys = sorted(self.awaiting)
        if wait:
            wait_any([self.replies[k] for k in keys], return_when=FIRST_COMPLETED)
        return [(k, self.replies.pop(k).result()) for k in keys if self.replies[k].done()]
