"""The engine's step loop: schedule -> run -> record, until every request is done.

Each turn the :class:`~megarl.rollout.scheduler.Scheduler` plans a step, a
:class:`~megarl.rollout.runners.StepRunner` runs it, and the scheduler records
its sampled tokens. A runner whose steps leave their tokens on the device
(:meth:`~megarl.rollout.runners.StepRunner.runs_ahead`: graph replays on one
stage) lets the loop keep one step *pending*: step t + 1 is planned and
launched while the device still runs step t (the tokens it feeds are read on
the device), then t is recorded. A refill due while a step is pending is
launched the same way when it fits the runner's ``ahead_tokens`` (a mixed one,
whose decode rows read the pending tokens on the device, is held to them, so it
never runs eagerly); a larger one runs once the pending step is recorded.

With a feed (``NativeEngine.serve``) each turn starts by handing out the
finished requests and taking follow-ups, before the plan-ahead check: a new
request waits in the queue and is admitted like any refill.

With ``stop`` (``NativeEngine.generate_until``) each turn first asks it whether
enough has finished; if so the loop records the pending step and ends, leaving
the unfinished sequences in the scheduler with every token they sampled.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Protocol

from megarl.rollout.runners import StepOutput, StepRunner
from megarl.rollout.scheduler import Scheduler, StepPlan

clock = time.perf_counter


class Feed(Protocol):
    """Between steps: finished requests out, follow-up requests in (``NativeEngine.serve``)."""

    def exchange(self, sched: Scheduler, idle: bool) -> None:
        """Hands out ``sched``'s finished sequences and queues new ones; ``idle``: nothing else runs."""


@dataclass
class StepCounters:
    """What one generate call's loop did: step counts, and wall seconds (run-dependent, unlike the counts)."""

    prefill: int = 0
    """prefill steps, mixed ones included"""
    prefill_tokens: int = 0
    """prompt tokens computed (those shared with a group's leader or found in the prefix cache are not)"""
    mixed: int = 0
    """prefill steps that also decoded a token of every running sequence"""
    decode: int = 0
    """decode steps"""
    graph: int = 0
    """decode steps replayed through a CUDA graph"""
    prefill_graph: int = 0
    """prefill steps replayed through a CUDA graph"""
    ahead: int = 0
    """decode steps launched before the pending step's tokens were read back"""
    prefill_ahead: int = 0
    """refills launched before the pending step's tokens were read back"""
    prefill_s: float = 0.0
    """seconds in prefill steps run synchronously (run and recorded at once)"""
    sync_s: float = 0.0
    """seconds in decode steps run synchronously"""
    wait_s: float = 0.0
    """seconds waiting for a pending step's tokens"""
    plan_s: float = 0.0
    """seconds in the scheduler's ``next_step``"""
    launch_s: float = 0.0
    """seconds launching steps ahead"""
    loop_s: float = 0.0
    """seconds of the whole loop"""

    def count(self, plan: StepPlan, out: StepOutput) -> None:
        """One step run (or launched)."""
        if plan.decode:
            self.decode += 1
            self.graph += out.via_graph
        else:
            self.prefill += 1
            self.prefill_tokens += len(plan.input_ids) - plan.decoding
            self.mixed += plan.decoding > 0
            self.prefill_graph += out.via_graph

    def metrics(self) -> dict[str, float]:
        """The engine's ``rollout/`` counters and ``timing/rollout_*`` seconds of this call."""
        return {
            "rollout/prefill_steps": float(self.prefill), "rollout/decode_steps": float(self.decode),
            "rollout/prefill_tokens": float(self.prefill_tokens),
            "rollout/graph_steps": float(self.graph), "rollout/planned_ahead_steps": float(self.ahead),
            "rollout/prefill_graph_steps": float(self.prefill_graph),
            "rollout/planned_ahead_prefills": float(self.prefill_ahead),
            "rollout/mixed_steps": float(self.mixed),
            "timing/rollout_prefill": self.prefill_s, "timing/rollout_device_wait": self.wait_s,
            "timing/rollout_loop": self.loop_s,
            # host time of the steps launched ahead: planning, launching, recording
            "timing/rollout_host": self.loop_s - self.wait_s - self.prefill_s - self.sync_s,
            "timing/rollout_host_plan": self.plan_s, "timing/rollout_host_launch": self.launch_s,
        }


class StepLoop:
    """Runs one generate call's steps: ``sched`` plans them, ``runner`` runs them."""

    def __init__(self, sched: Scheduler, runner: StepRunner, feed: Feed | None = None,
                 stop: Callable[[Scheduler], bool] | None = None):
        self.sched, self.runner, self.feed, self.stop = sched, runner, feed, stop
        self.counters = StepCounters()
        self.pending: tuple[StepPlan, StepOutput] | None = None  # launched ahead, not yet recorded

    def run(self) -> StepCounters:
        """Steps until every request is done; what they were."""
        start = clock()
        while self._turn():
            pass
        if self.pending is not None:
            self._record_pending()
        self.counters.loop_s = clock() - start
        return self.counters

    def _turn(self) -> bool:
        """Plans and runs (or launches) the next step; False when nothing is left."""
        sched = self.sched
        if self.stop is not None and self.stop(sched):
            return False
        if self.feed is not None:
            self.feed.exchange(sched, idle=self.pending is None and not sched.has_work())
        if self.pending is not None and not sched.can_plan_ahead():
            refill = sched.plan_prefill(self.runner.ahead_tokens)
            if refill is not None and self.runner.runs_ahead(refill):
                self._launch_ahead(refill)
            else:  # what the pending step finished goes out (and may be answered) before the next plan
                self._record_pending()
                if refill is not None:
                    self._run_now(refill)
            return True
        if not sched.has_work():
            return False
        start = clock()
        plan = sched.next_step()
        self.counters.plan_s += clock() - start
        if self.runner.runs_ahead(plan):
            self._launch_ahead(plan)
        else:
            self._run_now(plan)
        return True

    def _run_now(self, plan: StepPlan) -> None:
        """Runs ``plan`` and records its tokens at once."""
        start = clock()
        out = self.runner.run(plan)
        self.counters.count(plan, out)
        self.sched.commit(plan, *out.result())
        if plan.decode:
            self.counters.sync_s += clock() - start
        else:
            self.counters.prefill_s += clock() - start

    def _launch_ahead(self, plan: StepPlan) -> None:
        """Launches ``plan``, advances it with its tokens left on the device, then records the step that
        was pending; ``plan`` is pending now."""
        start = clock()
        out = self.runner.run(plan)
        self.counters.count(plan, out)
        self.counters.launch_s += clock() - start
        self.sched.advance(plan, on_device=True, row_base=out.row_base)
        if self.pending is not None:
            if plan.decode:
                self.counters.ahead += 1
            else:
                self.counters.prefill_ahead += 1
            self._record_pending()
        self.pending = plan, out

    def _record_pending(self) -> None:
        plan, out = self.pending
        start = clock()
        tokens, logprobs = out.result()
        self.counters.wait_s += clock() - start
        self.sched.record(plan, tokens, logprobs)
        self.pending = None
