"""Where the agents of ``rollout.server`` run: threads of the trainer's process, or worker processes.

Both give :class:`~megarl.rollout.http_agents.HttpAgentRollout` one future per sample, which
resolves to what its ``agent(sample, base_url)`` returned or fails with the reason it did not
(:class:`AgentFailed`: it raised, or it ran past the rollout's time limit).

- :class:`AgentThreads` (``rollout.server.agent_processes=0``): ``rollout.server.workers`` threads.
  Agent code shares the process, and its interpreter lock, with the engine's step loop: an agent's
  own Python work (its OpenAI client building and parsing each call, its tools) delays the engine's
  host side.
- :class:`AgentProcesses` (``agent_processes=N``): N worker processes started once (``spawn``: a CUDA
  process must not fork) and kept across rollouts, each running its share of the samples on
  ``workers / N`` threads; the agent travels by reference (a module-level function or a
  ``functools.partial`` of one), samples and results by pickle. A result that does not pickle
  and a worker that dies fail their samples, never the step (a dead pool is started again at the
  next rollout).
"""
from __future__ import annotations

import math
import multiprocessing
import pickle
import time
import traceback
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor, wait
from typing import Callable

# a call: (sample key, sample dict, base URL)
Call = tuple[int, dict, str]


class AgentFailed(Exception):
    """A sample's agent did not return: the message says why ("timed out", or its exception)."""


def _reason(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(e)).strip()


def _outcome(future: Future, finished: bool) -> tuple[bool, object]:
    """(returned, its result or the reason it did not) of one agent's thread future."""
    if not finished:
        return False, "timed out"
    if future.exception() is not None:
        return False, _reason(future.exception())
    return True, future.result()


class AgentThreads:
    """Agents on a thread pool of the trainer's process."""

    report_s = 0.0  # past the deadline, how long their outcomes may take to arrive

    def __init__(self, workers: int):
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="megarl-agent")

    def start(self, agent: Callable, calls: list[Call], timeout_s: float) -> dict[int, Future]:
        """A future per sample key; one whose agent has not returned by the caller's deadline is its timeout."""
        return {key: self._run(agent, sample, url) for key, sample, url in calls}

    def _run(self, agent: Callable, sample: dict, url: str) -> Future:
        out: Future = Future()

        def settle(f: Future) -> None:
            returned, value = _outcome(f, True)
            out.set_result(value) if returned else out.set_exception(AgentFailed(value))

        self.pool.submit(agent, sample, url).add_done_callback(settle)
        return out

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


_THREADS: ThreadPoolExecutor | None = None  # a worker process's agent threads, kept across rollouts


def run_in_worker(agent: Callable, calls: list[tuple[dict, str]], threads: int,
                  timeout_s: float) -> list[tuple[bool, object]]:
    """In a worker process: the agents of ``calls`` on ``threads`` threads, each outcome (returned,
    result or reason) once all returned or ``timeout_s`` passed; results that do not pickle are failures."""
    global _THREADS
    if _THREADS is None or _THREADS._max_workers < threads:
        _THREADS = ThreadPoolExecutor(threads, thread_name_prefix="megarl-agent")
    futures = [_THREADS.submit(agent, sample, url) for sample, url in calls]
    finished, _ = wait(futures, timeout=max(timeout_s, 0.0))
    out = []
    for f in futures:
        returned, value = _outcome(f, f in finished)
        if returned:
            try:
                pickle.dumps(value)
            except Exception as e:  # noqa: BLE001 - any pickling failure is this sample's
                returned, value = False, f"the agent's result cannot be sent back from its process: {_reason(e)}"
        out.append((returned, value))
    return out


class AgentProcesses:
    """Agents on ``processes`` worker processes, ``ceil(workers / processes)`` threads each."""

    report_s = 10.0  # a worker enforces the deadline itself, then sends its share's outcomes back

    def __init__(self, workers: int, processes: int):
        self.processes = processes
        self.threads = math.ceil(workers / processes)
        self.pool: ProcessPoolExecutor | None = None

    def _pool(self) -> ProcessPoolExecutor:
        if self.pool is None:
            self.pool = ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"))
        return self.pool

    def start(self, agent: Callable, calls: list[Call], timeout_s: float) -> dict[int, Future]:
        """Deals the calls round-robin over the processes; each sample's future settles when its
        process reports (every agent there returned, or ``timeout_s`` passed)."""
        futures = {key: Future() for key, _, _ in calls}
        pool, deadline = self._pool(), time.monotonic() + timeout_s
        for p in range(self.processes):
            share = calls[p::self.processes]
            if share:
                batch = pool.submit(run_in_worker, agent, [(s, url) for _, s, url in share], self.threads,
                                    deadline - time.monotonic())
                batch.add_done_callback(lambda b, keys=[k for k, _, _ in share]: self._settle(b, keys, futures))
        return futures

    def _settle(self, batch: Future, keys: list[int], futures: dict[int, Future]) -> None:
        if batch.exception() is not None:  # the process died, or the agent could not be sent to it
            reason = f"agent worker process failed: {_reason(batch.exception())}"
            outcomes = [(False, reason)] * len(keys)
            broken, self.pool = self.pool, None  # replaced at the next rollout
            if broken is not None:
                _stop(broken)
        else:
            outcomes = batch.result()
        for key, (returned, value) in zip(keys, outcomes):
            futures[key].set_result(value) if returned else futures[key].set_exception(AgentFailed(value))

    def close(self) -> None:
        """Stops the workers now (an agent still running there, past its time limit, is killed)."""
        if self.pool is not None:
            _stop(self.pool)
            self.pool = None


def _stop(pool: ProcessPoolExecutor) -> None:
    workers = list((getattr(pool, "_processes", None) or {}).values())  # no public list before Python 3.14
    pool.shutdown(wait=False, cancel_futures=True)
    for process in workers:
        process.terminate()


def agent_workers(workers: int, processes: int):
    """Threads (``processes`` = 0) or worker processes, as ``rollout.server.agent_processes`` says."""
    return AgentProcesses(workers, processes) if processes > 0 else AgentThreads(workers)
