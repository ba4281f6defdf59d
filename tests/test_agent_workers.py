"""Agents on threads or worker processes (``rollout.server.agent_processes``): the same outcomes.

Each sample's future gives what its agent returned, or fails with :class:`AgentFailed` saying why:
the agent raised (its exception's line), ran past the time limit ("timed out"), returned something
that cannot be sent back from its process, or its process died — and the next rollout runs again.
"""
import os
import time

import pytest

from megarl.rollout.agent_workers import AgentFailed, AgentProcesses, AgentThreads, agent_workers


def double(sample, base_url):
    return {"reward": 2.0 * sample["x"], "url": base_url, "pid": os.getpid()}


def flaky(sample, base_url):
    if sample["x"] == 1:
        raise RuntimeError("agent bug")
    if sample["x"] == 2:
        time.sleep(8)  # past the limit
    if sample["x"] == 3:
        return lambda: None  # a result that cannot be pickled
    return sample["x"]


def dies(sample, base_url):
    os._exit(3)


def _calls(n):
    return [(k, {"x": k}, f"http://h/samples/{k}/v1") for k in range(n)]


def _outcomes(futures, wait_s):
    from concurrent.futures import wait

    wait(list(futures.values()), timeout=wait_s)
    out = {}
    for key, f in futures.items():
        if not f.done():
            out[key] = "not done"
        elif f.exception() is not None:
            assert isinstance(f.exception(), AgentFailed)
            out[key] = str(f.exception())
        else:
            out[key] = f.result()
    return out


@pytest.fixture(scope="module")
def processes():
    workers = AgentProcesses(workers=8, processes=2)
    yield workers
    workers.close()


def test_threads_and_processes_return_what_the_agents_return(processes):
    threads = AgentThreads(8)
    by_threads = _outcomes(threads.start(double, _calls(12), 60.0), 60.0)
    by_processes = _outcomes(processes.start(double, _calls(12), 60.0), 60.0)
    threads.close()
    strip = lambda out: {k: {**v, "pid": None} for k, v in out.items()}  # noqa: E731
    assert strip(by_threads) == strip(by_processes) == {
        k: {"reward": 2.0 * k, "url": f"http://h/samples/{k}/v1", "pid": None} for k in range(12)}
    assert {v["pid"] for v in by_threads.values()} == {os.getpid()}
    pids = {v["pid"] for v in by_processes.values()}
    assert len(pids) == 2 and os.getpid() not in pids  # round-robin over both processes


def test_failures_are_samples_not_crashes(processes):
    start = time.monotonic()
    out = _outcomes(processes.start(flaky, _calls(5), 3.0), 3.0 + AgentProcesses.report_s)
    assert time.monotonic() - start < 3.0 + AgentProcesses.report_s  # the worker enforced the limit itself
    assert out[0] == 0 and out[4] == 4
    assert out[1] == "RuntimeError: agent bug"
    assert out[2] == "timed out"
    assert out[3].startswith("the agent's result cannot be sent back from its process")
    threads = AgentThreads(8)
    out = _outcomes(threads.start(flaky, _calls(5), 3.0), 3.0)
    assert out[1] == "RuntimeError: agent bug" and out[2] == "not done" and callable(out[3])  # threads: no pickling
    threads.close()


def test_a_dead_worker_fails_its_samples_and_the_next_rollout_runs():
    workers = agent_workers(workers=4, processes=2)
    out = _outcomes(workers.start(dies, _calls(4), 30.0), 30.0)
    assert all(v.startswith("agent worker process failed") for v in out.values())
    again = _outcomes(workers.start(double, _calls(4), 30.0), 30.0)
    assert [again[k]["reward"] for k in range(4)] == [0.0, 2.0, 4.0, 6.0]
    workers.close()


def test_an_environment_episode_travels_to_a_worker_process():
    """rollout.server.environment's agent (megarl/rollout/factory.py): a partial of run_episode over the
    environment class, sent by reference."""
    import pickle
    from functools import partial

    from megarl.agents.calculator_env import CalculatorEnv
    from megarl.agents.environment import run_episode

    agent = partial(run_episode, CalculatorEnv, max_turns=2, model="m")
    back = pickle.loads(pickle.dumps(agent))
    assert back.func is run_episode and back.args == (CalculatorEnv,) and back.keywords == agent.keywords
