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
"""
from __future__ import annotations

import time
from typing import Protocol

from megarl.rollout.runners import StepOutput, StepRunner
from megarl.rollout.scheduler import Scheduler, StepPlan

clock = time.perf_counter


class Feed(Protocol):
    """Between steps: finished requests out, follow-up requests in (``NativeEngine.serve``)."""

    def exchange(self, sched: Scheduler, idle: bool) -> None:
        """Hands out ``sched``'s finished sequences and queues new ones; ``idle``: nothing else runs."""


def new_counters() -> dict:
    return {"prefill": 0, "prefill_tokens": 0, "prefill_graph": 0, "decode": 0, "graph": 0, "ahead": 0,
            "prefill_ahead": 0, "mixed": 0,
            "prefill_s": 0.0, "sync_s": 0.0, "wait_s": 0.0, "loop_s": 0.0, "plan_s": 0.0, "launch_s": 0.0}


class StepLoop:
    """Runs one generate call's steps: ``sched`` plans them, ``runner`` runs them."""

    def __init__(self, sched: Scheduler, runner: StepRunner, feed: Feed | None = None):
        self.sched, self.runner, self.feed = sched, runner, feed
        self.steps = new_counters()
        self.pending: tuple[StepPlan, StepOutput] | None = None  # launched ahead, not yet recorded

    def run(self) -> dict:
        """Steps until every request is done; returns the counters."""
        start = clock()
        while self._turn():
            pass
        if self.pending is not None:
            self._record_pending()
        self.steps["loop_s"] = clock() - start
        return self.steps

    def _turn(self) -> bool:
        """Plans and runs (or launches) the next step; False when nothing is left."""
        sched = self.sched
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
        self.steps["plan_s"] += clock() - start
        if self.runner.runs_ahead(plan):
            self._launch_ahead(plan)
        else:
            self._run_now(plan)
        return True

    def _run_now(self, plan: StepPlan) -> None:
        """Runs ``plan`` and records its tokens at once."""
        start = clock()
        out = self.runner.run(plan)
        self._count(plan, out)
        self.sched.commit(plan, *out.result())
        self.steps["prefill_s" if not plan.decode else "sync_s"] += clock() - start

    def _launch_ahead(self, plan: StepPlan) -> None:
        """Launches ``plan``, advances it with its tokens left on the device, then records the step that
        was pending; ``plan`` is pending now."""
        start = clock()
        out = self.runner.run(plan)
        self._count(plan, out)
        self.steps["launch_s"] += clock() - start
        self.sched.advance(plan, on_device=True, row_base=out.row_base)
        if self.pending is not None:
            self.steps["ahead" if plan.decode else "prefill_ahead"] += 1
            self._record_pending()
        self.pending = plan, out

    def _record_pending(self) -> None:
        plan, out = self.pending
        start = clock()
        tokens, logprobs = out.result()
        self.steps["wait_s"] += clock() - start
        self.sched.record(plan, tokens, logprobs)
        self.pending = None

    def _count(self, plan: StepPlan, out: StepOutput) -> None:
        s = self.steps
        s["decode" if plan.decode else "prefill"] += 1
        if not plan.decode:
            s["prefill_tokens"] += len(plan.input_ids) - plan.decoding
            s["mixed"] += plan.decoding > 0
        if out.via_graph:
            s["graph" if plan.decode else "prefill_graph"] += 1
